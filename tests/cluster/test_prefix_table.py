"""The router's memory of which replica holds which prefix (no Ray needed)."""

from __future__ import annotations

from ruvllm_cli.cluster.prefix_table import PrefixTable, prefix_hashes


def test_full_blocks_only_and_never_the_last_token():
    assert len(prefix_hashes(list(range(16)), 4, 100)) == 3     # 15 tokens count: 3 full blocks
    assert len(prefix_hashes(list(range(17)), 4, 100)) == 4
    assert prefix_hashes([1, 2, 3], 4, 100) == []
    assert len(prefix_hashes(list(range(1000)), 4, 10)) == 10


def test_hashes_chain_over_the_prefix_and_the_salt():
    a = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 10)
    b = prefix_hashes([1, 2, 3, 4, 0, 6, 7, 8, 9], 4, 10)
    c = prefix_hashes([9, 9, 9, 9, 5, 6, 7, 8, 9], 4, 10)
    assert a[0] == b[0] and a[1] != b[1]
    assert a[1] != c[1]                       # the same second block after another first block
    assert prefix_hashes([1, 2, 3, 4, 5], 4, 10, salt=(None, "sql")) != prefix_hashes([1, 2, 3, 4, 5], 4, 10)


def test_the_longest_known_prefix_wins_among_live_replicas():
    table = PrefixTable(100)
    system = list(range(32))
    chat_a = prefix_hashes(system + [100] * 16 + [1], 16, 10)
    chat_b = prefix_hashes(system + [200] * 16 + [1], 16, 10)
    table.record(chat_a, "r1")
    table.record(chat_b, "r2")
    assert table.match(chat_a, {"r1", "r2"}).replica == "r1"
    assert table.match(chat_b, {"r1", "r2"}).replica == "r2"
    # Only the shared system prompt is known for a new chat: its last holder (2 blocks).
    fresh = prefix_hashes(system + [300] * 16 + [1], 16, 10)
    assert (table.match(fresh, {"r1", "r2"}).replica, table.match(fresh, {"r1", "r2"}).blocks) == ("r2", 2)
    # Among r1 alone: the system prompt's blocks moved to r2 with chat_b, so nothing matches.
    assert table.match(chat_b, {"r1"}).replica is None
    table.forget("r2")
    assert table.match(chat_b, {"r1", "r2"}).replica is None


def test_least_recently_routed_blocks_are_forgotten_first():
    table = PrefixTable(4)
    old, new = prefix_hashes(list(range(33)), 16, 10), prefix_hashes(list(range(100, 133)), 16, 10)
    table.record(old, "r1")
    table.record(new, "r2")
    table.record(prefix_hashes(list(range(200, 233)), 16, 10), "r1")
    assert len(table) == 4
    assert table.match(old, {"r1", "r2"}).replica is None
    assert table.match(new, {"r1", "r2"}).replica == "r2"
