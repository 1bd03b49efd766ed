"""The peer-memory barriers wait as long as their group was reserved with (CPU: the workspace itself,
which needs CUDA, is replaced by a recorder; the GPU engine test checks the engine's setting)."""

import pytest

from parallel.tensor_parallel import peer_memory


@pytest.fixture
def grown(monkeypatch):
    calls = []
    monkeypatch.setattr(peer_memory, "_workspace", lambda group, nbytes: calls.append((group, nbytes)))
    monkeypatch.setattr(peer_memory, "_barrier_timeouts_ms", {})
    return calls


def test_reserve_sets_the_groups_barrier_timeout(grown):
    assert peer_memory.barrier_timeout_ms("tp0") == peer_memory.BARRIER_TIMEOUT_MS  # never reserved
    peer_memory.reserve("tp0", 1 << 20, barrier_timeout_s=1200.0)
    assert grown == [("tp0", 1 << 20)]
    assert peer_memory.barrier_timeout_ms("tp0") == 1_200_000
    assert peer_memory.barrier_timeout_ms("tp1") == peer_memory.BARRIER_TIMEOUT_MS  # per group


def test_a_timeout_that_is_not_positive_is_refused_before_the_workspace_grows(grown):
    with pytest.raises(ValueError, match="positive"):
        peer_memory.reserve("tp0", 8, barrier_timeout_s=0)
    assert grown == []
