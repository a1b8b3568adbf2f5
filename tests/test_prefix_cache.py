"""The prefix index alone (pure bookkeeping): longest full-block matches, bounded memory, LRU."""

from flover.engine.prefix_cache import BlockCopy, PrefixCache


def test_lookup_finds_the_longest_cached_prefix_in_whole_blocks():
    cache = PrefixCache(num_blocks=8, block_tokens=4)
    seq = list(range(100, 111))  # 11 tokens: two full blocks
    saved = cache.store(seq, len(seq), slot=3)
    assert saved == [BlockCopy(3, 0, saved[0].block), BlockCopy(3, 4, saved[1].block)]
    assert cache.store(seq, len(seq), slot=5) == []  # already there
    hit = cache.lookup(seq[:8] + [1, 2, 3], limit=10, slot=0)
    assert [(c.slot, c.position) for c in hit] == [(0, 0), (0, 4)]
    assert [c.block for c in hit] == [c.block for c in saved]
    assert cache.lookup(seq, limit=7, slot=0) == hit[:1]  # only blocks within the limit
    assert cache.lookup([100, 101, 102, 999] + seq[4:], limit=11, slot=0) == []  # the first block differs
    # the same tokens at another place in a sequence are another block (the chain includes the parent)
    assert cache.lookup(seq[4:8] + seq[:4], limit=8, slot=0) == []
    s = cache.stats
    assert (s.lookups, s.hits, s.cached_tokens, s.stored_blocks) == (4, 2, 12, 2)


def test_bounded_pool_evicts_the_least_recently_used_leaf_first():
    cache = PrefixCache(num_blocks=3, block_tokens=2)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    cache.store(a, 4, slot=0)  # blocks a0, a1
    cache.store(b, 4, slot=1)  # b0 takes the last free row; b1 evicts the LRU: a's leaf a1, not its root
    assert cache.used_blocks == 3 and cache.stats.evicted_blocks == 1
    assert len(cache.lookup(a, 4, 0)) == 1 and len(cache.lookup(b, 4, 0)) == 2
    # a sequence never evicts its own blocks: with a pool of 3, a 4-block sequence keeps 3
    cache = PrefixCache(num_blocks=3, block_tokens=2)
    assert len(cache.store(list(range(8)), 8, slot=0)) == 3
    assert len(cache.lookup(list(range(8)), 8, 0)) == 3


def test_a_parent_stored_again_is_a_new_block_its_old_children_never_match():
    cache = PrefixCache(num_blocks=3, block_tokens=2)
    root, _leaf = (BlockCopy(0, 0, c.block) for c in cache.store([1, 2, 3, 4], 4, slot=0))
    evicted = cache._lru.pop(root.block)  # as if the root alone had been evicted
    del cache._by_key[evicted.key]
    cache._free.append(root.block)
    cache.store([1, 2], 2, slot=0)  # the root again, under a new id
    assert len(cache.lookup([1, 2, 3, 4], 4, 0)) == 1


def test_salted_requests_share_cached_prefixes_only_with_their_own_salt():
    cache = PrefixCache(num_blocks=8, block_tokens=2)
    tokens = [1, 2, 3, 4, 5]
    assert len(cache.store(tokens, 5, slot=0, salt="alice")) == 2
    assert cache.lookup(tokens, 4, slot=1, salt="mallory") == []
    assert cache.lookup(tokens, 4, slot=1) == []  # nor the common partition
    assert len(cache.lookup(tokens, 4, slot=1, salt="alice")) == 2
    assert len(cache.store(tokens, 5, slot=0)) == 2  # the same tokens, unsalted: blocks of their own
