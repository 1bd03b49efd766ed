"""What ``parallel.tp_comm auto`` and ``train.cuda_graphs`` null become on each kind of machine."""

import pytest

from megazero.config import load_config, validate_config
from megazero.config.auto import resolve_auto

TP2_SP = ("--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--model.num_layers", "4")


def _resolved(*overrides: str, on_cuda: bool = True, peer_memory: bool = True) -> tuple[str, bool, bool]:
    cfg = load_config(None, list(overrides))
    validate_config(cfg)
    out = resolve_auto(cfg, on_cuda=on_cuda, peer_memory=peer_memory)
    return out.parallel.tp_comm, out.train.cuda_graphs, out.train.compile


def test_tensor_parallel_inside_a_node_takes_peer_memory_in_cuda_graphs():
    assert _resolved(*TP2_SP) == ("peer_memory", True, True)
    assert _resolved(*TP2_SP, "--zero.stage", "2", "--parallel.dp", "2") == ("peer_memory", True, True)


@pytest.mark.parametrize("overrides, machine", [
    ((), {}),  # tp 1: nothing to exchange
    (("--parallel.tp", "2"), {}),  # no sequence parallelism: the linears all-reduce through NCCL
    (TP2_SP, {"on_cuda": False}),
    (TP2_SP, {"peer_memory": False}),  # a torch without symmetric memory
    ((*TP2_SP, "--parallel.allow_tp_across_nodes", "true"), {}),
    ((*TP2_SP, "--parallel.pp", "2"), {}),
    ((*TP2_SP, "--zero.stage", "3"), {}),
    ((*TP2_SP, "--parallel.recompute", "full"), {}),
    ((*TP2_SP, "--parallel.recompute", "selective"), {}),  # its attention cores recompute inside backward too
    ((*TP2_SP, "--model.dropout", "0.1"), {}),
    ((*TP2_SP, "--model.attention_dropout", "0.1"), {}),
    ((*TP2_SP, "--train.compile", "false"), {}),
    ((*TP2_SP, "--train.cuda_graphs", "false"), {}),
    ((*TP2_SP, "--train.device", "cpu"), {}),
    ((*TP2_SP, "--precision.dtype", "fp16"), {}),  # graphs untested with the loss scaler
    ((*TP2_SP, "--zero.offload_optimizer", "true"), {}),
])
def test_elsewhere_nccl_beside_the_products_without_graphs(overrides, machine):
    tp_comm, graphs, _ = _resolved(*overrides, **machine)
    assert (tp_comm, graphs) == ("overlap", False)


def test_zero_bubble_pipelines_keep_nccl():
    tp_comm, graphs, _ = _resolved(*TP2_SP, "--parallel.pp", "2", "--parallel.pipeline_schedule", "zb-h1")
    assert (tp_comm, graphs) == ("overlap", False)


def test_a_value_set_is_kept():
    assert _resolved(*TP2_SP, "--parallel.tp_comm", "overlap") == ("overlap", False, True)
    assert _resolved(*TP2_SP, "--parallel.tp_comm", "serial", "--train.cuda_graphs", "true") == ("serial", True, True)
    assert _resolved(*TP2_SP, "--parallel.tp_comm", "peer_memory") == ("peer_memory", True, True)
    assert _resolved(*TP2_SP, "--parallel.tp_comm", "peer_memory", "--train.cuda_graphs", "false") == (
        "peer_memory", False, True)
    assert _resolved(*TP2_SP, "--train.cuda_graphs", "true", peer_memory=False) == ("overlap", True, True)
    assert _resolved(*TP2_SP, "--train.cuda_graphs", "true") == ("peer_memory", True, True)
    assert _resolved(*TP2_SP, "--train.cuda_graphs", "true", "--precision.dtype", "fp16") == ("peer_memory", True, True)
    # peer memory set, its graphs blocked by the pipeline: it runs without
    assert _resolved(*TP2_SP, "--parallel.tp_comm", "peer_memory", "--parallel.pp", "2") == ("peer_memory", False, True)
    assert _resolved("--train.compile", "true", on_cuda=False)[2] is True
    assert _resolved(*TP2_SP, "--train.compile", "false")[2] is False  # on GPUs too


def test_compile_null_follows_the_device():
    assert _resolved(on_cuda=True)[2] is True
    assert _resolved(on_cuda=False)[2] is False


def test_resolving_twice_changes_nothing():
    cfg = load_config(None, list(TP2_SP))
    once = resolve_auto(cfg, on_cuda=True, peer_memory=True)
    assert resolve_auto(once, on_cuda=True, peer_memory=True) == once
