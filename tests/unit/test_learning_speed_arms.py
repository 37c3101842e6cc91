"""The learning-speed bench's arms: which lr an arm without its own selection takes, and what it trains with."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from bench.learning_speed import ARMS, PAIRINGS, RunSpec, _settings_notes, resolve_lrs, train_settings
from bench.learning_speed_report import ArmRun
from tracetrain.config import TrainConfig
from tracetrain.demo.run import DEMO_TRAINING, _write_config


def _selection(tmp_path: Path, chosen: dict[str, float]) -> Path:
    path = tmp_path / "learning_speed_lr.json"
    path.write_text(json.dumps({"raw": {"chosen": chosen}}))
    return path


def test_an_arm_without_a_selection_takes_its_nearest_selected_relative(tmp_path: Path) -> None:
    arms = ["tracetrain-vllm", "tracetrain-vllm-keep"]
    own = resolve_lrs(arms, [], _selection(tmp_path, {"tracetrain-transformers": 2e-4, "tracetrain-vllm": 4e-4}))
    assert own["tracetrain-vllm"][0] == 4e-4 and "chosen on the validation split" in own["tracetrain-vllm"][1]
    assert own["tracetrain-vllm-keep"][0] == 4e-4
    assert "differing only in train.flat_groups keep" in own["tracetrain-vllm-keep"][1]
    chained = resolve_lrs(arms, [], _selection(tmp_path, {"tracetrain-transformers": 2e-4}))
    assert chained["tracetrain-vllm-keep"][0] == 2e-4
    assert "differing only in the engine, train.flat_groups keep" in chained["tracetrain-vllm-keep"][1]
    assert resolve_lrs(arms, ["tracetrain-vllm-keep=1e-3"], _selection(tmp_path, {}))["tracetrain-vllm-keep"] == (
        1e-3, "--lr override")


@pytest.mark.parametrize(("arm", "flat_groups", "entropy_coef", "publish"), [
    ("tracetrain-vllm", "set_aside", 0.0, "reload"),
    ("tracetrain-vllm-keep", "keep", 0.0, "reload"),
    ("tracetrain-vllm-entropy", "set_aside", 0.01, "reload"),
    ("tracetrain-transformers", "set_aside", 0.0, "inprocess")])
def test_each_tracetrain_arm_serves_with_its_own_settings(arm: str, flat_groups: str, entropy_coef: float,
                                                          publish: str, tmp_path: Path) -> None:
    spec = RunSpec(arm, seed=3, lr=2e-4, minutes=1, eval_every=30, eval_size=8, split="validation", order=0)
    config = _write_config(tmp_path, 8000, 8001, ARMS[arm].engine, {"train": train_settings(spec)})
    train = TrainConfig.model_validate(yaml.safe_load(config.read_text())["train"])
    assert (train.flat_groups, train.entropy_coef, train.publish, train.lr, train.seed) == (
        flat_groups, entropy_coef, publish, 2e-4, 3)
    own = {"flat_groups", "entropy_coef", "publish", "lr", "seed", "checkpoint_dir"}
    assert train.model_dump(exclude=own) == TrainConfig.model_validate(DEMO_TRAINING).model_dump(exclude=own)


def test_the_report_names_the_settings_an_arm_has_of_its_own() -> None:
    """The best-engine pairing's tracetrain arm differs from TRL's by an entropy bonus: the report says so."""
    args = argparse.Namespace(minutes=15.0, eval_size=96, split="test", eval_every=90.0)
    runs = [ArmRun(arm=arm, seed=0, lr=2e-4, split="test", budget_s=900.0) for arm in PAIRINGS["best-engine"][2]]
    notes = _settings_notes(args, runs, {0: list(PAIRINGS["best-engine"][2])})
    assert PAIRINGS["best-engine"][2] == ("tracetrain-vllm-entropy", "trl-hf")
    assert [n for n in notes if n.startswith("settings of an arm's own")] == [
        "settings of an arm's own, on top of the above: tracetrain + vLLM, entropy bonus 0.01: train.entropy_coef 0.01"]
    plain = _settings_notes(args, [ArmRun(arm="tracetrain-vllm", seed=0, lr=2e-4, split="test", budget_s=900.0)],
                            {0: ["tracetrain-vllm"]})
    assert not any(n.startswith("settings of an arm's own") for n in plain)
