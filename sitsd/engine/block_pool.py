"""The KV block pool: reference counts, an LRU free queue and the prefix-cache hash map.

A block is *free* when no request references it (`ref_cnt == 0`). A free block may still hold
the KV of a full, hashed block; it then stays findable in the prefix cache until it is evicted,
which happens only when the pool needs a block and takes it from the head of the free queue
(least recently freed first). Block ids only: the tensors live in the model runner.

What to allocate, and when, is `KVCacheManager`'s business (`kv_cache_manager.py`).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_key: str = ""
) -> BlockHash:
    """Chained hash of one full block: covers every token before it, through `parent_hash`.

    `extra_key` separates caches that must never share blocks (the weights version: KV written
    by one set of weights is wrong for another).
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash if parent_hash is not None else extra_key.encode())
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


@dataclass(slots=True)
class KVBlock:
    """One block of the pool."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and cached


class BlockPool:
    """Owns every block: allocation, freeing, and the prefix cache's hash -> block map."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first. Cached ones stay in it until evicted.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}

    # ---------------------------------------------------------------------------- accounting

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one live request."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    # ---------------------------------------------------------------------------- allocation

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` free blocks (evicting cached ones, oldest first), ref_cnt 1 each."""
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self._free)} are free")
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference to cached blocks found by `lookup` (out of the free queue if there)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference to each block; unreferenced ones go to the free queue's tail.

        Pass a request's blocks in reverse order so that its tail blocks (least likely to be
        shared) are evicted before its prefix.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    # -------------------------------------------------------------------------- prefix cache

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The cached block with this hash, if any (no reference taken)."""
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash so later requests can reuse it."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is cached already; this one stays private
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (after a weight swap); returns how many were dropped."""
        dropped = len(self._cached)
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return dropped

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
