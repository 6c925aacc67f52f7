"""KV events: which prefix blocks a prefix cache holds, named by a deterministic hash a router can recompute.

A block is `block_size` consecutive tokens at a block-aligned offset; its hash chains the previous block's hash
with its own token ids (blake2b, 64 bits), so equal hashes mean equal whole prefixes. Python's hash() is salted
per process and would differ between pods; this one is the same everywhere.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field


def block_hashes(tokens: list[int], block_size: int, start_block: int = 0, parent: int = 0) -> list[int]:
    """Chained hashes of the full blocks of `tokens`, from block `start_block` (whose parent hash is `parent`)."""
    out, h = [], parent
    for j in range(start_block, len(tokens) // block_size):
        block = tokens[j * block_size : (j + 1) * block_size]
        digest = hashlib.blake2b(struct.pack(f"<q{len(block)}q", h, *block), digest_size=8).digest()
        h = int.from_bytes(digest, "little", signed=True)
        out.append(h)
    return out


@dataclass
class KVEvents:
    """Blocks stored and removed since the last drain (a block both stored and removed cancels out)."""

    block_size: int
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)

    def on_stored(self, hashes: list[int]) -> None:
        """The cache came to hold the last token of each of these blocks."""
        self.stored += hashes

    def on_removed(self, hashes: list[int]) -> None:
        """The cache gave up the last token of each of these blocks."""
        self.removed += hashes

    def drain(self) -> tuple[list[int], list[int]]:
        stored, removed = self.stored, self.removed
        self.stored, self.removed = [], []
        gone, kept = set(removed), set(stored)
        return [h for h in stored if h not in gone], [h for h in removed if h not in kept]
