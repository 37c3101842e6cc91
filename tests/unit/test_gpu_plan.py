"""How vLLM's replicas and the trainer share a machine's GPUs (engines/gpus.py), and the refusals.

This machine has no GPU, so the GPU count is passed in (`plan_gpus` is a pure function) or the
driver's list is replaced (`_driver_gpus`, the one call to `nvidia-smi`): a stand-in for hardware
that cannot exist here. What the lent GPU machines check for real is in tests/gpu/.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest

from tracetrain.cli import gpu_args, settle
from tracetrain.config import load_config
from tracetrain.engines import gpus
from tracetrain.engines.gpus import ALONE_SHARE, ASYNC_SHARE, SYNC_SHARE, plan_gpus


def _plan(visible: int, **overrides: Any) -> gpus.GPUPlan:
    values: dict[str, Any] = {"replicas": 1, "workers": 1, "engine_gpus": [], "trainer_gpus": [], "mode": "async",
                              "memory_share": None, "sleep": "auto", **overrides}
    return plan_gpus(visible=visible, **values)


def test_one_gpu_is_shared_and_vllm_sleeps_in_sync_mode() -> None:
    synced = _plan(1, mode="sync")
    assert (synced.engine, synced.trainer, synced.memory_share, synced.sleep) == ([0], [0], SYNC_SHARE, True)
    both = _plan(1, mode="async")  # one GPU: the two split its memory, nobody sleeps
    assert (both.engine, both.trainer, both.memory_share, both.sleep) == ([0], [0], ASYNC_SHARE, False)
    serving = _plan(1, workers=0)  # no trainer on the GPU: vLLM's own default share
    assert (serving.engine, serving.trainer, serving.memory_share, serving.sleep) == ([0], [], ALONE_SHARE, False)


def test_several_gpus_are_split_engine_first() -> None:
    plan = _plan(8, replicas=2, workers=4)
    assert (plan.engine, plan.trainer, plan.shared, plan.memory_share) == ([0, 1], [2, 3, 4, 5], [], ALONE_SHARE)
    chosen = _plan(4, engine_gpus=[3], trainer_gpus=[0, 1], workers=2)
    assert (chosen.engine, chosen.trainer) == ([3], [0, 1])
    assert _plan(4, memory_share=0.7).memory_share == 0.7


def test_no_gpu_places_nothing() -> None:
    plan = _plan(0, replicas=2, workers=2)
    assert (plan.engine, plan.trainer, plan.memory_share, plan.sleep) == ([], [], None, False)


@pytest.mark.parametrize(("visible", "overrides", "sentence"), [
    (2, {"engine_gpus": [2]}, "engine.gpus names GPU [2], but 2 GPU(s) are visible"),
    (2, {"trainer_gpus": [1, 1]}, "train.gpus names a GPU twice"),
    (4, {"engine_gpus": [0, 1]}, "engine.gpus lists 2 GPU(s) for 1 vLLM replica(s)"),
    (4, {"trainer_gpus": [2, 3]}, "train.gpus lists 2 GPU(s) for train.workers=1"),
    (2, {"replicas": 3}, "3 vLLM replicas need a GPU each, and 2 are visible"),
    (2, {"engine_gpus": [0], "trainer_gpus": [0]}, "both use GPU [0] in async mode"),
    (2, {"replicas": 2}, "both use GPU [0] in async mode"),  # the default leaves the trainer no GPU of its own
    (2, {"workers": 3, "mode": "sync"}, "train.workers=3 needs a GPU each"),
    (2, {"sleep": "on"}, "engine.sleep: on puts vLLM to sleep"),
    (0, {"sleep": "on"}, "needs a GPU"),
    (0, {"engine_gpus": [0]}, "0 GPU(s) are visible"),
])
def test_impossible_splits_are_refused_with_a_sentence(visible: int, overrides: dict[str, Any], sentence: str) -> None:
    with pytest.raises(ValueError, match=re.escape(sentence)):
        _plan(visible, **overrides)


def test_overlap_is_allowed_in_sync_mode_where_vllm_sleeps() -> None:
    plan = _plan(2, replicas=2, mode="sync")
    assert (plan.engine, plan.trainer, plan.shared, plan.sleep) == ([0, 1], [0], [0], True)


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpus, "_driver_gpus", lambda: ("0", "1", "2", "3"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpus.visible_gpus() == ["0", "1", "2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert gpus.visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus.visible_gpus() == []


def test_config_resolves_the_split_and_vllm_gets_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpus, "_driver_gpus", lambda: ("0",))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = settle(load_config(engine={"kind": "vllm"}, train={"mode": "sync"}), training_here=True)
    assert (config.engine.gpus, config.train.gpus, config.engine.sleep) == ([0], [0], "on")
    assert gpu_args(config.engine) == ["--gpu-memory-utilization", "0.6", "--enable-sleep-mode"]
    serving = settle(load_config(engine={"kind": "vllm"}), training_here=False)
    assert gpu_args(serving.engine) == ["--gpu-memory-utilization", "0.9"]
    assert (serving.engine.sleep, serving.train.gpus) == ("off", [])


def test_config_refuses_named_gpus_when_it_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpus, "_driver_gpus", lambda: ("0", "1"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ValueError, match="both use GPU"):
        load_config(engine={"gpus": "1"}, train={"gpus": "1"})
    with pytest.raises(ValueError, match="engine.gpus places the vLLM servers this gateway starts"):
        load_config(engine={"gpus": [0], "urls": ["http://127.0.0.1:9"]})
    assert load_config(engine={"gpus": "0"}, train={"gpus": "1"}).train.gpus == [1]


def test_serve_refuses_gpus_this_machine_lacks() -> None:
    """The real command on this machine (no GPU, or none that nvidia-smi lists): a sentence, no traceback."""
    run = subprocess.run([sys.executable, "-m", "tracetrain.cli", "serve", "--set", "engine.gpus=0"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "engine.gpus names GPU [0]" in run.stderr and "Traceback" not in run.stderr


def test_the_fsdp_workers_local_ray_sees_only_the_trainers_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from tracetrain.config import TrainConfig
    from tracetrain.trainer.devices import trainer_visible_devices

    monkeypatch.setattr(gpus, "_driver_gpus", lambda: ("0", "1", "2", "3"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,0")  # this process's GPUs 1 and 2 are the driver's 1 and 0
    assert trainer_visible_devices(TrainConfig(gpus=[1, 2], workers=2)) == "1,0"
    assert trainer_visible_devices(TrainConfig(workers=2)) is None
    assert trainer_visible_devices(TrainConfig(gpus=[1, 2], workers=2, ray_address="auto")) is None
