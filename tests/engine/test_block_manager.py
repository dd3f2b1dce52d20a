"""Block pool bookkeeping: exact block ids, reference counts, prefix hits, LRU eviction."""

from ruvllm_cli.engine.block_manager import BlockManager
from ruvllm_cli.engine.request import Request
from ruvllm_cli.engine.sampling import SamplingParams


def make(tokens, salt=None):
    return Request(prompt_ids=list(tokens), params=SamplingParams(), cache_salt=salt)


def admit(bm: BlockManager, request: Request) -> list[int]:
    """What the scheduler does for a new request whose whole prompt is computed."""
    hits = bm.match_prefix(request.all_token_ids, request.cache_salt)
    bm.allocate_prefix(request, hits)
    assert bm.grow(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    bm.cache_full_blocks(request)
    return hits


def test_allocation_takes_lowest_free_ids_in_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make(range(10)), make(range(100, 105))
    admit(bm, a)
    admit(bm, b)
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [3, 4]
    assert bm.num_free_blocks == 3
    bm.check_integrity([a, b])


def test_prefix_hit_reuses_full_blocks_and_is_capped_one_token_short():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make(range(8))                       # exactly two full blocks
    admit(bm, a)
    b = make(range(8))                       # same prompt: the last token must still be computed
    assert bm.match_prefix(b.all_token_ids) == [0]
    c = make([*range(8), 50, 51])            # longer: both full blocks hit
    assert bm.match_prefix(c.all_token_ids) == [0, 1]
    admit(bm, c)
    assert c.block_table == [0, 1, 2]
    assert [bm.blocks[i].ref_count for i in (0, 1, 2)] == [2, 2, 1]
    bm.check_integrity([a, c])


def test_salt_keeps_caches_apart():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, make(range(9), salt="tenant-a"))
    assert bm.match_prefix(list(range(9)), "tenant-a") == [0, 1]
    assert bm.match_prefix(list(range(9)), "tenant-b") == []
    assert bm.match_prefix(list(range(9)), None) == []


def test_freed_blocks_stay_cached_until_evicted_lru_tail_first():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make(range(12))                      # blocks 0,1,2 (block 2 full: 12 tokens)
    admit(bm, a)
    b = make(range(100, 108))                # blocks 3,4
    admit(bm, b)
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_blocks == 5 and bm.num_free_blocks == 6
    # The free queue: never-used block 5 first, then a's blocks tail first, then b's.
    assert list(bm.free_queue) == [5, 2, 1, 0, 4, 3]
    c = make(range(200, 212))                # needs 3 new blocks: 5, then evicts 2 and 1
    admit(bm, c)
    assert c.block_table == [5, 2, 1]
    assert bm.stats.evictions == 2
    # a's first block survived; its chain is cut after it.
    assert bm.match_prefix(list(range(12)) + [0]) == [0]
    assert bm.match_prefix(list(range(100, 108)) + [0]) == [3, 4]
    bm.check_integrity([c])


def test_hit_on_a_free_cached_block_takes_it_off_the_free_queue():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make(range(5))
    admit(bm, a)
    bm.free(a)
    b = make(range(6))
    hits = admit(bm, b)
    assert hits == [0]
    assert 0 not in bm.free_queue and bm.blocks[0].ref_count == 1
    bm.check_integrity([b])


def test_hash_collision_is_not_a_hit():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make(range(5))
    admit(bm, a)
    block_hash = bm.blocks[0].block_hash
    bm.blocks[0].token_ids = (9, 9, 9, 9)   # stored ids no longer match the hash's tokens
    assert bm.match_prefix(list(range(5))) == []
    assert bm.cached[block_hash] == 0


def test_grow_refuses_without_side_effects_when_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = make(range(3))
    admit(bm, a)
    assert not bm.grow(a, 20)
    assert a.block_table == [0] and bm.num_free_blocks == 1


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    admit(bm, make(range(9)))
    assert bm.match_prefix(list(range(9))) == [] and bm.num_cached_blocks == 0


def test_integrity_catches_a_leak():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make(range(5))
    admit(bm, a)
    try:
        bm.check_integrity([])
    except AssertionError:
        return
    raise AssertionError("a held block with no owner must fail the check")
