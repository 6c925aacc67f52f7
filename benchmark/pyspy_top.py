"""Summarises a py-spy `record -f raw` file (collapsed stacks: "frame;frame;... count" per line): the share
of samples per thread, and the functions with the most samples on top of the stack (self) and anywhere in it
(inclusive). Usage: python3 benchmark/pyspy_top.py FILE [N]."""

from __future__ import annotations

import sys
from collections import Counter


def main(path: str, n: int = 25) -> None:
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        frames = stack.split(";")
        total += k
        threads[frames[0]] += k  # py-spy's first frame names the thread ("process N:..." / "thread (0x..)")
        own[frames[-1]] += k
        for frame in set(frames[1:]):
            anywhere[frame] += k
    print(f"{path}: {total} samples")
    for title, counter in (("threads", threads), ("self", own), ("inclusive", anywhere)):
        print(f"-- {title}")
        for frame, k in counter.most_common(n):
            print(f"  {100 * k / max(total, 1):5.1f}%  {frame[:150]}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25)
