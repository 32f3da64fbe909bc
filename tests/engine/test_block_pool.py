"""BlockPool: reference counts, LRU eviction, prefix-cache map."""

from __future__ import annotations

import random

import pytest

from sitsd.engine.block_pool import BlockPool, hash_block_tokens


def test_allocate_and_free_return_every_block():
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert pool.num_used_blocks == 5
    assert pool.num_free_blocks == 3
    assert len({b.block_id for b in blocks}) == 5
    pool.free(blocks)
    assert pool.num_used_blocks == 0
    assert pool.num_free_blocks == 8


def test_allocating_more_than_free_raises():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(ValueError, match="asked for 2 blocks, 1 are free"):
        pool.allocate(2)


def test_double_free_is_detected():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([block])


def test_cached_free_block_is_found_until_evicted():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache(a, h)
    pool.free([a, b])
    assert pool.lookup(h) is a
    pool.touch([a])
    assert a.ref_cnt == 1
    assert pool.num_free_blocks == 1
    pool.free([a])
    # a was freed last, so b (freed earlier) is evicted first, then a.
    (first,) = pool.allocate(1)
    assert first is b
    assert pool.lookup(h) is a
    (second,) = pool.allocate(1)
    assert second is a
    assert pool.lookup(h) is None
    assert a.block_hash is None


def test_shared_block_is_free_only_after_last_reference():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache(a, hash_block_tokens(None, [7] * 4))
    pool.touch([a])
    pool.free([a])
    assert pool.num_used_blocks == 1
    pool.free([a])
    assert pool.num_used_blocks == 0


def test_chained_hash_depends_on_every_earlier_token_and_the_key():
    toks = [random.randrange(1000) for _ in range(8)]
    h1 = hash_block_tokens(None, toks[:4])
    h2 = hash_block_tokens(h1, toks[4:])
    other_first = hash_block_tokens(None, [toks[0] + 1, *toks[1:4]])
    assert hash_block_tokens(other_first, toks[4:]) != h2
    assert hash_block_tokens(None, toks[:4], extra_key="v2") != h1
    assert hash_block_tokens(h1, toks[4:]) == h2


def test_reset_prefix_cache_forgets_hashes_but_keeps_references():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    for i, b in enumerate(blocks):
        pool.cache(b, hash_block_tokens(None, [i] * 4))
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached_blocks == 0
    assert pool.num_used_blocks == 2
    assert all(b.block_hash is None for b in blocks)


def test_disabled_prefix_cache_never_hits():
    pool = BlockPool(2, enable_prefix_caching=False)
    (a,) = pool.allocate(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache(a, h)
    assert pool.lookup(h) is None
