"""The replica router: sticky sessions, least-loaded new sessions, group affinity, spill and failover."""

from __future__ import annotations

import os

import pytest

from tracetrain.engines.base import Affinity
from tracetrain.engines.routing import NoReplica, Router
from tracetrain.engines.vllm_server import replica_placement


def test_a_session_stays_on_its_replica() -> None:
    router = Router(3, spill_at=4)
    first = router.pick(Affinity("s1"))
    assert first.reason == "least_loaded"
    router.started(first.replica)
    for _ in range(3):
        again = router.pick(Affinity("s1"))
        assert again.replica == first.replica and again.reason == "sticky"


def test_new_sessions_go_to_the_least_loaded_and_idle_replicas_share() -> None:
    router = Router(2, spill_at=8)
    router.outstanding = [3, 1]
    assert router.pick(Affinity("new")).replica == 1
    idle = Router(3, spill_at=8)
    replicas = {idle.pick(Affinity(f"s{i}")).replica for i in range(3)}
    assert replicas == {0, 1, 2}  # ties rotate instead of piling onto replica 0


def test_group_members_prefer_their_group_replica() -> None:
    router = Router(2, spill_at=8)
    first = router.pick(Affinity("a", "g"))
    router.started(first.replica)  # now the other replica is less loaded
    sibling = router.pick(Affinity("b", "g"))
    assert sibling.replica == first.replica and sibling.reason == "group"
    assert router.pick(Affinity("c", "other")).replica != first.replica


def test_an_overloaded_replica_spills_and_the_session_moves() -> None:
    router = Router(2, spill_at=2)
    home = router.pick(Affinity("s")).replica
    router.outstanding[home] = 2
    moved = router.pick(Affinity("s"))
    assert moved.replica != home and moved.reason == "spill"
    router.outstanding[home] = 0
    assert router.pick(Affinity("s")).replica == moved.replica  # it stays where its prefix now is


def test_no_spill_when_every_replica_is_as_loaded() -> None:
    router = Router(2, spill_at=2)
    home = router.pick(Affinity("s")).replica
    router.outstanding = [5, 5]
    assert router.pick(Affinity("s")).replica == home


def test_a_down_replica_fails_over_and_none_up_raises() -> None:
    router = Router(2, spill_at=8)
    home = router.pick(Affinity("s")).replica
    router.up[home] = False
    moved = router.pick(Affinity("s"))
    assert moved.replica != home and moved.reason == "failover"
    with pytest.raises(NoReplica):
        router.pick(Affinity("s"), exclude={moved.replica})


def test_round_robin_ignores_sessions() -> None:
    router = Router(2, spill_at=8, policy="round_robin")
    picks = [router.pick(Affinity("s")) for _ in range(4)]
    assert [p.replica for p in picks] in ([1, 0, 1, 0], [0, 1, 0, 1])
    assert {p.reason for p in picks} == {"round_robin"}


def test_replicas_started_here_get_devices_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert replica_placement(0, 1) == {}  # one server on the CPU keeps vLLM's own binding
    assert replica_placement(0, 1, every_core=True) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1,2,3"}
    places = [replica_placement(i, 2) for i in range(2)]
    assert [p["VLLM_CPU_OMP_THREADS_BIND"] for p in places] == ["0,1", "2,3"]
    assert "CUDA_VISIBLE_DEVICES" not in places[0]
    assert replica_placement(1, 2, gpu="6")["CUDA_VISIBLE_DEVICES"] == "6"  # the GPU plan's choice (engines/gpus.py)
    assert replica_placement(0, 1, gpu="GPU-1f2e") == {"CUDA_VISIBLE_DEVICES": "GPU-1f2e"}
    assert replica_placement(0, 1, gpu="3", every_core=True) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert [p["VLLM_CPU_OMP_THREADS_BIND"] for p in (replica_placement(i, 2, every_core=True) for i in range(2))] \
        == ["0,1", "2,3"]  # replicas share the cores out whatever the setting
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert replica_placement(1, 2)["VLLM_CPU_OMP_THREADS_BIND"] == "0"  # more replicas than cores: shared
