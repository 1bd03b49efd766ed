"""Real gloo worlds of 4 and 8 ranks build the groups; membership is checked by all-reducing ids."""

import pytest
import torch
import torch.distributed as dist

from parallel import comm
from parallel.topology import GROUP_KINDS, RankGrid, Topology
from tests.distributed import run_world

LAYOUTS = {4: [(2, 2, 1, "tp-dp-pp"), (2, 1, 2, "tp-dp-pp"), (1, 2, 2, "tp-pp-dp")],
           8: [(2, 2, 2, "tp-dp-pp"), (2, 2, 2, "tp-pp-dp"), (1, 4, 2, "tp-dp-pp")]}


def _membership(rank, world_size):
    report = {}
    for tp, pp, dp, order in LAYOUTS[world_size]:
        topo = Topology(RankGrid(tp=tp, pp=pp, dp=dp, order=order))
        for kind in GROUP_KINDS:
            group = topo.group(kind)
            if group is None:
                report[(tp, pp, dp, order, kind)] = None
                continue
            ids = torch.tensor([float(rank)])
            dist.all_reduce(ids, group=group)
            gathered = torch.zeros(dist.get_world_size(group))
            comm.all_gather_into(gathered, torch.tensor([float(rank)]), group)
            report[(tp, pp, dp, order, kind)] = (ids.item(), sorted(int(x) for x in gathered.tolist()))
        # activations and gradients need two communicators (parallel.pipeline.plan.CHANNELS)
        report[(tp, pp, dp, order, "pp_grad is its own group")] = topo.pp_grad_group is not topo.pp_group or pp == 1
        size = topo.dp_size
        full = torch.arange(size * 2, dtype=torch.float32) * (rank + 1)
        out = torch.zeros(2)
        comm.reduce_scatter_into(out, full, topo.dp_group)
        report[(tp, pp, dp, order, "reduce_scatter")] = out.tolist()
    try:
        Topology(RankGrid(tp=2, pp=1, dp=1))
    except ValueError as exc:
        report["mismatch"] = str(exc)
    report["world"] = comm.describe_group(None)
    report["hang"] = _hang(rank)
    return report


def _hang(rank):
    """Rank 1 never joins rank 0's all-reduce: rank 0 must fail naming itself, the op and the group."""
    import datetime
    import time

    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2), group_desc="tp")
    if rank == 0:
        try:
            comm.all_reduce(torch.ones(1), group)
        except comm.CollectiveError as exc:
            return str(exc)
        return "no error"
    if rank == 1:
        time.sleep(5)
    return None


@pytest.fixture(scope="module", params=[4, 8])
def world(request):
    return request.param, run_world(request.param, _membership)


def test_every_group_has_exactly_its_members(world):
    world_size, reports = world
    for (tp, pp, dp, order) in ((l[0], l[1], l[2], l[3]) for l in LAYOUTS[world_size]):
        grid = RankGrid(tp=tp, pp=pp, dp=dp, order=order)
        for rank, report in enumerate(reports):
            for kind in GROUP_KINDS:
                expected = grid.group_of(kind, rank)
                got = report[(tp, pp, dp, order, kind)]
                if not expected:
                    assert got is None
                    continue
                assert got == (float(sum(expected)), expected), (rank, kind)
            assert report[(tp, pp, dp, order, "pp_grad is its own group")], rank


def test_reduce_scatter_shim_sums_over_dp(world):
    world_size, reports = world
    for tp, pp, dp, order in LAYOUTS[world_size]:
        grid = RankGrid(tp=tp, pp=pp, dp=dp, order=order)
        for rank, report in enumerate(reports):
            group = grid.group_of("dp", rank)
            scale = sum(r + 1 for r in group)
            me = group.index(rank)
            assert report[(tp, pp, dp, order, "reduce_scatter")] == [float(2 * me * scale), float((2 * me + 1) * scale)]


def test_hung_collective_names_rank_operation_and_group(world):
    world_size, reports = world
    message = reports[0]["hang"]
    assert message.startswith("rank 0: all_reduce on the tp group of 2 ranks [0, 1] failed"), message


def test_a_grid_of_another_size_is_refused_on_every_rank(world):
    """A grid that does not cover the world would leave ranks outside every group (or name ranks that
    do not exist); each rank refuses it before making any group."""
    world_size, reports = world
    for report in reports:
        assert report.get("mismatch") == f"grid tp2 x dp1 x pp1 = 2 ranks does not match the world size {world_size}"


def test_a_group_is_described_with_its_first_eight_ranks(world):
    """Up to eight ranks are listed whole; only a larger group's list ends in an ellipsis."""
    world_size, reports = world
    listed = ", ".join(map(str, range(world_size)))
    assert reports[0]["world"] == f"world group of {world_size} ranks [{listed}]"


def test_coalesced_sum_applies_its_scale_to_a_lone_tensor_of_its_dtype(one_rank_group):
    """The data-parallel mean of the pipeline's gradients is a coalesced sum times ``1 / dp``; a dtype
    with a single gradient is summed in place, and must be scaled all the same (a group of one rank
    sums nothing, so only the scale shows)."""
    from parallel.comm import all_reduce_coalesced

    lone, pair = torch.ones(3, dtype=torch.float64), [torch.ones(2), torch.full((2, 2), 2.0)]
    all_reduce_coalesced([lone, *pair], one_rank_group, scale=0.5)
    assert torch.equal(lone, torch.full((3,), 0.5, dtype=torch.float64))
    assert torch.equal(pair[0], torch.full((2,), 0.5)) and torch.equal(pair[1], torch.ones(2, 2))
