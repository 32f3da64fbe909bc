"""Which KV blocks each request holds: prefix-cache lookups, slot allocation, freeing.

Works on block ids through `BlockPool`; knows nothing of tensors. A request's blocks cover its
tokens in order: token `i` lives in block `block_ids[i // block_size]` at offset
`i % block_size`. Full blocks are registered in the prefix cache under a chained hash once
their KV has been computed (`cache_full_blocks`, called after a step succeeded), keyed by the
request's weights version, so KV written by one set of weights is never reused by another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sitsd.engine.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from sitsd.engine.request import Request


@dataclass(slots=True)
class _RequestBlocks:
    blocks: list[KVBlock] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)  # of its full blocks, in order
    hash_key: str = ""  # the weights version the hashes were computed under
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache


class KVCacheManager:
    """Allocates and frees the blocks of requests; counts prefix-cache queries and hits."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._reqs: dict[str, _RequestBlocks] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # prompt tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -------------------------------------------------------------------------- prefix cache

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """Cached blocks holding a prefix of the request's tokens (no reference taken).

        At most `num_tokens - 1` tokens are taken from the cache: the last token must be
        computed to produce logits.
        """
        entry = self._entry(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in entry.hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        entry = self._reqs.get(request.req_id)
        if entry is None or not self.pool.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(entry.blocks))
        if num_full <= entry.num_cached_blocks:
            return
        self._extend_hashes(request, entry, num_full)
        for i in range(entry.num_cached_blocks, num_full):
            self.pool.cache(entry.blocks[i], entry.hashes[i])
        entry.num_cached_blocks = num_full

    # ---------------------------------------------------------------------------- allocation

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens; None if the pool cannot.

        Args:
            request: its `num_computed_tokens` must not yet count `computed_blocks`.
            num_new_tokens: tokens to compute this step.
            computed_blocks: prefix-cache hits from `get_computed_blocks`, taken here.

        Returns:
            The block ids appended to the request's table (hits first), possibly empty.
        """
        if not computed_blocks:
            # The common decode case: the request's blocks already have room.
            entry = self._reqs.get(request.req_id)
            if (
                entry is not None
                and entry.hash_key == request.weights_version
                and (
                    request.num_computed_tokens + num_new_tokens
                    <= len(entry.blocks) * self.block_size
                )
            ):
                return []
        computed_blocks = computed_blocks or []
        entry = self._entry(request)
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_required = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = max(0, num_required - len(entry.blocks) - len(computed_blocks))
        # Cache hits sitting in the free queue stop being free once taken.
        num_free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            return None
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.allocate(num_new_blocks)
        entry.blocks.extend(computed_blocks)
        entry.blocks.extend(new_blocks)
        entry.num_cached_blocks = max(entry.num_cached_blocks, len(computed_blocks))
        return [b.block_id for b in computed_blocks] + [b.block_id for b in new_blocks]

    def free(self, request: Request) -> None:
        """Return every block of the request to the pool (cached ones stay findable)."""
        entry = self._reqs.pop(request.req_id, None)
        if entry is not None:
            self.pool.free(entry.blocks[::-1])

    def transfer(self, source: Request, target: Request) -> None:
        """Give `source`'s blocks to `target` (a migrated request takes its shadow's KV).

        `target`'s own blocks must have been freed; the blocks' hashes stay keyed by the
        version they were computed under, which `target` takes too.
        """
        if target.req_id in self._reqs:
            raise ValueError(f"request {target.req_id!r} still holds blocks")
        entry = self._reqs.pop(source.req_id, None)
        if entry is not None:
            self._reqs[target.req_id] = entry

    def num_private_blocks(self, request: Request) -> int:
        """Blocks only this request references: what freeing it would return to the pool."""
        entry = self._reqs.get(request.req_id)
        return sum(1 for b in entry.blocks if b.ref_cnt == 1) if entry else 0

    def block_ids(self, request: Request) -> list[int]:
        entry = self._reqs.get(request.req_id)
        return [b.block_id for b in entry.blocks] if entry else []

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    # ------------------------------------------------------------------------------ internal

    def _entry(self, request: Request) -> _RequestBlocks:
        entry = self._reqs.get(request.req_id)
        if entry is None:
            entry = self._reqs[request.req_id] = _RequestBlocks(hash_key=request.weights_version)
        if entry.hash_key != request.weights_version:
            entry.hashes.clear()
            entry.hash_key = request.weights_version
        self._extend_hashes(request, entry, request.num_tokens // self.block_size)
        return entry

    def _extend_hashes(self, request: Request, entry: _RequestBlocks, num_blocks: int) -> None:
        if len(entry.hashes) >= num_blocks:
            return
        tokens = request.all_token_ids
        bs = self.block_size
        parent = entry.hashes[-1] if entry.hashes else None
        for i in range(len(entry.hashes), num_blocks):
            parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], entry.hash_key)
            entry.hashes.append(parent)
