"""Grid arithmetic for large layouts, checked without starting any process."""

import pytest

from parallel.topology import GROUP_KINDS, RankGrid


def _check_partition(grid: RankGrid, kind: str, size: int) -> None:
    groups = grid.groups(kind)
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(grid.world_size)), f"{kind}: every rank in exactly one group"
    assert all(len(g) == size for g in groups)


@pytest.mark.parametrize("order", ["tp-dp-pp", "tp-pp-dp"])
def test_mtnlg_530b_layout(order):
    grid = RankGrid(tp=8, pp=35, dp=8, order=order)
    assert grid.world_size == 2240
    _check_partition(grid, "tp", 8)
    _check_partition(grid, "dp", 8)
    _check_partition(grid, "pp", 35)
    _check_partition(grid, "mp", 8 * 35)
    for group in grid.groups("tp"):  # 8 ranks per node: every tensor group inside one node
        assert len({r // 8 for r in group}) == 1
    assert grid.tp_within_nodes(8)
    for rank in (0, 1, 7, 8, 63, 64, 1000, 2239):
        c = grid.coord(rank)
        assert grid.rank_of(c.tp, c.dp, c.pp) == rank
        for kind in ("tp", "dp", "pp", "mp"):
            assert rank in grid.group_of(kind, rank)
            assert grid.group_of(kind, rank) in grid.groups(kind)


def test_documented_order_tp_fastest_then_dp_then_pp():
    grid = RankGrid(tp=8, pp=35, dp=8)
    assert grid.coord(0) == grid.coord(0).__class__(tp=0, dp=0, pp=0)
    assert grid.coord(1).tp == 1 and grid.coord(8).dp == 1 and grid.coord(64).pp == 1
    assert grid.groups("dp")[0] == [0, 8, 16, 24, 32, 40, 48, 56]
    assert grid.groups("pp")[0] == [64 * p for p in range(35)]
    alt = RankGrid(tp=8, pp=35, dp=8, order="tp-pp-dp")
    assert alt.coord(8).pp == 1 and alt.coord(8 * 35).dp == 1
    assert alt.groups("pp")[0] == [8 * p for p in range(35)]


def test_embedding_groups_pair_first_and_last_stage():
    grid = RankGrid(tp=2, pp=4, dp=2)
    for pipe, emb in zip(grid.groups("pp"), grid.groups("embedding")):
        assert emb == sorted([pipe[0], pipe[-1]])
    assert grid.group_of("embedding", grid.rank_of(0, 0, 1)) == []
    single = RankGrid(tp=2, pp=1, dp=2)
    assert all(len(g) == 1 for g in single.groups("embedding"))


def test_describe_names_layout_and_nodes():
    assert RankGrid(8, 35, 8).describe(8) == "tp8 x dp8 x pp35 = 2240 ranks on 280 nodes; tp groups within nodes"
    assert "SPANNING" in RankGrid(16, 1, 1).describe(8)
    assert RankGrid(2, 1, 5).describe(4).endswith("= 10 ranks on 3 nodes; tp groups within nodes")  # a part-full node
    assert RankGrid(2, 1, 2).describe(8).endswith("= 4 ranks on 1 node; tp groups within nodes")
    assert RankGrid(1, 1, 1).describe(1) == "tp1 x dp1 x pp1 = 1 rank on 1 node; tp groups within nodes"


def test_a_tensor_group_that_does_not_divide_the_node_spans_nodes():
    """tp 4 on nodes of 6 ranks fits a node by count, but the second group (ranks 4-7) straddles the
    first two nodes: it must be reported as spanning, not within."""
    grid = RankGrid(tp=4, pp=1, dp=3)
    assert len({r // 6 for r in grid.groups("tp")[1]}) == 2
    assert not grid.tp_within_nodes(6) and "SPANNING" in grid.describe(6)
    assert grid.tp_within_nodes(8) and RankGrid(tp=3, pp=1, dp=2).tp_within_nodes(6)


def test_a_group_kind_is_within_nodes_only_where_every_group_is():
    """24 ranks at 8 a node, tp 2 x dp 3 x pp 4: the data-parallel groups are 6 ranks wide, yet the one
    of ranks 6, 8 and 10 starts at the end of node 0 and ends in node 1 (planted, as the planner had it:
    stride x size within a node's width); at 12 a node they all fit, and tp-pp-dp puts them 8 apart."""
    grid = RankGrid(tp=2, pp=4, dp=3)
    assert [6, 8, 10] in grid.groups("dp")
    assert not grid.within_nodes("dp", 8) and grid.within_nodes("dp", 12)
    assert grid.within_nodes("tp", 8) and not grid.within_nodes("pp", 8)
    across = RankGrid(tp=2, pp=4, dp=3, order="tp-pp-dp")
    assert across.within_nodes("pp", 8) and not across.within_nodes("dp", 8)
    assert RankGrid(tp=4, pp=1, dp=3).within_nodes("tp", 6) is False  # ranks 4-7 straddle two nodes


def test_rejects_unknown_kind_and_order():
    with pytest.raises(ValueError):
        RankGrid(1, 1, 1, order="pp-tp-dp")
    with pytest.raises(ValueError):
        RankGrid(1, 1, 1).groups("xx")
    for sizes in ((0, 1, 1), (1, 0, 1), (1, 1, 0)):
        with pytest.raises(ValueError, match="grid sizes must be positive"):
            RankGrid(*sizes)
    assert set(GROUP_KINDS) == {"tp", "dp", "pp", "pp_grad", "pp_back", "pp_grad_back", "mp", "embedding"}
