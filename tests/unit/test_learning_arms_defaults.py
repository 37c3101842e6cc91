"""The `hard+defaults` arms run the trainer as `serve --train` does for a user who set nothing: the
config file the demo writes for them trains with `TrainConfig`'s defaults wherever the demo has its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench.learning_arms import ARMS
from tracetrain.config import TrainConfig, parse_set
from tracetrain.demo.run import DEMO_TRAINING, _write_config


def _trained_with(arm: str, out: Path) -> TrainConfig:
    written = _write_config(out, 8000, 8001, "vllm", parse_set(list(ARMS[arm].train)))
    return TrainConfig.model_validate(yaml.safe_load(written.read_text())["train"])


def _demo_keys(config: TrainConfig) -> dict[str, object]:
    """The settings the demo pins, as `config` has them."""
    return {key: getattr(config, key) for key in DEMO_TRAINING}


@pytest.mark.parametrize("arm", ["hard+defaults", "hard+defaults+set-aside"])
def test_the_defaults_arms_train_with_the_trainers_defaults(arm: str, tmp_path: Path) -> None:
    trained, defaults = _trained_with(arm, tmp_path), TrainConfig()
    others = {key: value for key, value in _demo_keys(trained).items() if key != "flat_groups"}
    assert others == {key: value for key, value in _demo_keys(defaults).items() if key != "flat_groups"}
    assert trained.flat_groups == ("set_aside" if arm.endswith("+set-aside") else defaults.flat_groups)


def test_the_demos_own_settings_differ_from_the_defaults(tmp_path: Path) -> None:
    """Otherwise the arms above would compare nothing: the demo pins settings of its own."""
    trained = _trained_with("hard", tmp_path)
    assert _demo_keys(trained) != _demo_keys(TrainConfig())
