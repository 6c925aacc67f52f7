"""runtime.process.freeze_heap: what a started process holds leaves the cycle collector's view; what the work
makes afterwards is still collected."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from kubesgl.runtime.process import freeze_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cycle collector frees it


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the test process's heap goes back to the collector


def test_startup_objects_are_frozen_and_later_garbage_is_still_collected(unfrozen: None) -> None:
    startup = Node()
    freeze_heap()
    assert gc.get_freeze_count() > 0
    assert not any(startup is o for o in gc.get_objects())  # out of every generation the collector scans
    later = Node()
    gone = weakref.ref(later)
    del later
    gc.collect()
    assert gone() is None
    del startup


def test_garbage_from_before_the_freeze_is_collected_first(unfrozen: None) -> None:
    old = Node()
    gone = weakref.ref(old)
    del old
    freeze_heap()
    assert gone() is None  # collected, not frozen forever
