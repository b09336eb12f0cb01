"""The paged KV cache: a pool of fixed-size blocks with reference counts and a prefix cache.

As in vLLM's `BlockPool`, a freed block keeps its content hash and stays findable until it is reused; free
blocks are handed out least-recently-freed first, so a popular prefix survives while the pool has room.
"""

from __future__ import annotations

from collections import OrderedDict

BlockHash = int


class KvBlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks if self.num_blocks else 0.0

    def lookup(self, hashes: list[BlockHash], max_blocks: int) -> list[int]:
        """The longest run of leading blocks already cached (at most `max_blocks`)."""
        hits: list[int] = []
        if not self.enable_caching:
            return hits
        cached = self._cached
        for h in hashes[:max_blocks]:
            b = cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def can_allocate(self, new_blocks: int, hits: list[int]) -> bool:
        # hit blocks that sit in the free list are taken out of it by touching them
        reclaimed = sum(1 for b in hits if self._ref[b] == 0)
        return new_blocks <= len(self._free) - reclaimed

    def touch(self, hits: list[int]) -> None:
        ref, free = self._ref, self._free
        for b in hits:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int, out: list[int]) -> bool:
        """Append `n` fresh blocks to `out`, evicting cached content; False (nothing taken) if too few."""
        free = self._free
        if n > len(free):
            return False
        ref, hashes, cached = self._ref, self._hash, self._cached
        for _ in range(n):
            b, _none = free.popitem(last=False)
            h = hashes[b]
            if h is not None:
                if cached.get(h) == b:
                    del cached[h]
                hashes[b] = None
            ref[b] = 1
            out.append(b)
        return True

    def free_blocks(self, blocks: list[int]) -> None:
        # tail blocks first, so a request's shared prefix is the last to be evicted
        ref, free = self._ref, self._free
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None
        blocks.clear()

    def reset_prefix_cache(self) -> int:
        """Forget the content of every free block (those in use keep theirs, as vLLM's reset does not touch a
        running request's); the number forgotten. A run measured again starts as cold as the first."""
        forgotten = 0
        for b in self._free:
            h = self._hash[b]
            if h is not None:
                if self._cached.get(h) == b:
                    del self._cached[h]
                self._hash[b] = None
                forgotten += 1
        return forgotten

    def register(self, block: int, h: BlockHash) -> None:
        """Mark a full block's content, so later requests with the same prefix can share it."""
        if self.enable_caching and self._hash[block] is None and h not in self._cached:
            self._hash[block] = h
            self._cached[h] = block


def block_hashes(token_ids: list[int], block_size: int) -> list[BlockHash]:
    """Chained hashes of the full blocks of a prompt: equal hashes mean equal prefixes."""
    out: list[BlockHash] = []
    prev = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash((prev, *token_ids[start : start + block_size]))
        out.append(prev)
    return out
