"""One config object: defaults < YAML < TRACETRAIN_ environment < CLI flags; loopback-only without keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tracetrain.config import Config, TrainConfig, load_config, parse_set


def test_precedence_yaml_env_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tt.yaml"
    path.write_text("port: 9000\nengine: transformers\ndb_url: sqlite:///from-yaml.db\nreward_weights: {a: 2}\n")
    monkeypatch.setenv("TRACETRAIN_PORT", "9100")
    monkeypatch.setenv("TRACETRAIN_API_KEYS", '["k1", "k2"]')
    config = load_config(path, db_url="sqlite:///from-flag.db")
    assert config.port == 9100
    assert config.engine == "transformers"
    assert config.db_url == "sqlite:///from-flag.db"
    assert config.api_keys == ["k1", "k2"]
    assert config.reward_weights == {"a": 2.0}


def test_unknown_yaml_keys_are_errors(tmp_path: Path) -> None:
    path = tmp_path / "tt.yaml"
    path.write_text("prot: 9000\n")
    with pytest.raises(ValueError, match="prot"):
        load_config(path)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_loopback_runs_without_keys(host: str) -> None:
    Config(host=host).check_access()


def test_other_addresses_need_keys() -> None:
    with pytest.raises(SystemExit, match="api_keys"):
        Config(host="0.0.0.0").check_access()
    with pytest.raises(SystemExit):
        Config(host="0.0.0.0", api_keys=["k"]).check_access()
    Config(host="0.0.0.0", api_keys=["k"], admin_key="a").check_access()


def test_nested_train_settings_merge_across_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tt.yaml"
    path.write_text("train:\n  advantage: grpo\n  lr: 0.001\n  batch_sessions: 24\n")
    monkeypatch.setenv("TRACETRAIN_TRAIN__MAX_STALENESS", "5")
    monkeypatch.setenv("TRACETRAIN_TRAIN__BATCH_SESSIONS", "20")
    config = load_config(path, **parse_set(["train.lr=1e-4", "lora=false", "admission=staleness"]))
    assert (config.train.advantage, config.train.lr, config.train.lora, config.train.max_staleness) == \
        ("grpo", 1e-4, False, 5)
    assert config.train.batch_sessions == 20 and config.admission == "staleness"


def test_set_takes_the_same_keys_everywhere_and_refuses_unknown_ones() -> None:
    config = Config(**parse_set(["lr=1e-4", "train.lora=false", "port=9001"]))
    assert (config.train.lr, config.train.lora, config.port) == (1e-4, False, 9001)
    for bad in ("nosuch=1", "train.nosuch=1", "train", "db.url=x", "train.lr.x=1"):
        with pytest.raises(SystemExit, match="no such setting|KEY=VALUE"):
            parse_set([bad])


def test_batch_and_admission_combinations_are_checked_when_the_config_loads() -> None:
    with pytest.raises(ValidationError, match="min_sessions"):
        Config(train={"batch_sessions": 8, "min_sessions": 9})
    # the trainer takes the freshest first: beyond max_staleness + 1 batches, admitted work can only go stale
    with pytest.raises(ValidationError, match="admission_batches"):
        Config(admission="staleness", admission_batches=3, train={"max_staleness": 1})
    assert Config(admission="staleness", admission_batches=1.5, train={"batch_sessions": 32}).admission_limit == 48
    with pytest.raises(ValidationError, match="admission"):
        Config(admission="fifo")


def test_admission_auto_holds_agents_only_for_an_async_trainer_in_this_gateway() -> None:
    def resolved(mode: str, training_here: bool) -> str:
        return Config(**parse_set([f"mode={mode}"])).settled(training_here=training_here).admission

    assert resolved("async", True) == "staleness"
    assert resolved("sync", True) == "none"  # the sync hold already bounds staleness
    assert resolved("async", False) == "none"  # `serve` alone: no trainer here to wait for
    explicit = Config(**parse_set(["admission=none"])).settled(training_here=True)
    assert explicit.admission == "none"


def _autos(model: Any, prefix: str = "") -> list[str]:
    found = []
    for name, value in model:
        if isinstance(value, TrainConfig):
            found += _autos(value, f"{name}.")
        elif value == "auto":
            found.append(prefix + name)
    return found


@pytest.mark.parametrize("training_here", [True, False])
@pytest.mark.parametrize("overrides", [{}, {"engine": "vllm", "train": {"lora": True}},
                                       {"engine": "transformers", "train": {"workers": 2}},
                                       {"engine": "vllm", "gateway_workers": 2, "train": {"lora": True}}])
def test_a_settled_config_holds_no_auto_and_loading_rewrites_nothing(overrides: dict[str, Any],
                                                                     training_here: bool) -> None:
    """Every `auto` is decided once, as a command starts (`Config.settled`); loading leaves what was set."""
    loaded = Config(**overrides)
    assert loaded.train.publish == "auto"  # validators decide nothing and rewrite nothing
    settled = loaded.settled(training_here=training_here)
    left = _autos(settled)
    # The trainer's device is decided where it trains; a gateway that does not train may lack torch.
    assert left == ([] if training_here else ["train.device"]), left
    assert settled.train.publish == loaded.publish_mode() and settled.publish_mode() == loaded.publish_mode()


def test_publish_auto_loads_adapters_where_full_weights_cannot_work() -> None:
    """Several gateway processes, or a canary on one vLLM server: LoRA is published as adapters."""
    assert Config(engine="vllm", gateway_workers=2, train={"lora": True}).publish_mode() == "lora"
    assert Config(engine="vllm", promotion="canary", train={"lora": True}).publish_mode() == "lora"
    assert Config(engine="vllm", train={"lora": False}).publish_mode() == "reload"
    assert Config(engine="transformers", train={"lora": True}).publish_mode() == "inprocess"
    assert Config(engine="vllm", train={"lora": True, "publish": "none"}).publish_mode() == "none"


def test_lora_reaches_a_cpu_only_vllm_as_merged_weights() -> None:
    import torch

    assert TrainConfig(lora=True, publish="auto").publishes_merged() is not torch.cuda.is_available()
    assert TrainConfig(lora=True, publish="lora").publishes_merged() is False
    assert TrainConfig(lora=True, publish="reload").publishes_merged() is True
    assert TrainConfig(lora=False, publish="reload").publishes_merged() is False


def test_trainer_placement_is_checked_when_the_config_loads() -> None:
    from tracetrain.trainer.devices import check_hardware

    for bad, match in ((["backend=local", "workers=2"], "needs train.backend fsdp"),
                       (["workers=2", "algorithm=sft"], "local backend only"),
                       (["ray_address=auto"], "places fsdp workers")):
        with pytest.raises(ValidationError, match=match):
            Config(**parse_set(bad))
    assert Config(**parse_set(["workers=2"])).train.uses_fsdp
    many = Config(**parse_set(["workers=4096", "device=cpu"])).train
    with pytest.raises(ValueError, match="4096.*CPU cores.*ray_address"):
        check_hardware(many)
    check_hardware(Config(**parse_set(["workers=4096", "device=cpu", "ray_address=auto"])).train)  # a cluster's


def test_cuda_is_refused_where_torch_sees_none() -> None:
    import torch

    from tracetrain.trainer.devices import check_hardware

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")  # the refusal cannot be seen here
    with pytest.raises(ValueError, match="train.device=cuda, but torch sees no CUDA device"):
        check_hardware(TrainConfig(device="cuda"))


def test_engine_urls_from_every_source_and_replica_combinations(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACETRAIN_ENGINE_URL", "http://a:8000,http://b:8000")
    assert load_config().engine_url == ["http://a:8000", "http://b:8000"]
    monkeypatch.delenv("TRACETRAIN_ENGINE_URL")
    (tmp_path / "c.yaml").write_text("engine_url: http://a:8000\n")
    assert load_config(tmp_path / "c.yaml").engine_url == ["http://a:8000"]
    assert load_config(engine_url=["http://x:1", "http://y:2"]).engine_url == ["http://x:1", "http://y:2"]
    for bad, words in (({"engine_url": ["http://a:1"], "replicas": 2}, "list every server"),
                       ({"engine": "transformers", "replicas": 2}, "engine: vllm"),
                       ({"replica_spill_at": 100}, "never spill")):
        with pytest.raises(ValidationError, match=words):
            load_config(**bad)


def test_several_gateway_workers_prefer_lora_and_refuse_what_one_process_decides() -> None:
    assert load_config(gateway_workers=2).publish_mode() == "lora"  # `auto` with LoRA decides it
    # Full weights are reloaded in agreement between the processes (proxy/replica_sync.py).
    assert load_config(gateway_workers=2, train={"publish": "reload"}).train.publish == "reload"
    assert not load_config(gateway_workers=2, train={"lora": False}).train.lora
    for bad in ({"engine": "transformers", "train": {"publish": "lora"}},
                {"promotion": "canary", "replicas": 2, "train": {"publish": "reload"}}):
        with pytest.raises(ValidationError, match="gateway_workers > 1"):
            load_config(gateway_workers=2, **bad)


def test_canary_promotion_needs_both_versions_in_the_engines() -> None:
    assert Config(promotion="canary").publish_mode() == "lora"  # one vLLM: two adapters side by side
    with pytest.raises(ValueError, match="two or more vLLM replicas"):
        Config(promotion="canary", train={"publish": "reload"})
    two = Config(promotion="canary", replicas=2, train={"publish": "reload"})  # a replica each
    assert two.train.publish == "reload"
    assert Config(promotion="canary", engine="transformers", train={"publish": "inprocess"}).promotion == "canary"
    with pytest.raises(ValueError, match="canary_max_sessions"):
        Config(promotion="canary", canary_min_sessions=50, canary_max_sessions=20)


def test_gateway_cpus_take_lists_and_ranges_from_every_source(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Config(gateway_cpus="0").gateway_cpus == [0]
    assert Config(gateway_cpus=[1, 0, 1]).gateway_cpus == [0, 1]
    assert load_config(None, gateway_cpus="0-1").gateway_cpus == [0, 1]
    monkeypatch.setenv("TRACETRAIN_GATEWAY_CPUS", "1,0")
    assert load_config(None).gateway_cpus == [0, 1]


@pytest.mark.parametrize(("value", "words"), [
    ("two", "not a CPU number"), ("1-", "not a CPU number"), ("4096", "not available to this process"),
])
def test_gateway_cpus_that_cannot_be_pinned_are_refused_when_the_config_loads(value: str, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        Config(gateway_cpus=value)


def test_gateway_cpus_refuse_an_in_process_engine() -> None:
    with pytest.raises(ValidationError, match="engine: transformers generates in it"):
        Config(gateway_cpus="0", engine="transformers")


def test_gateway_cpus_with_train_are_refused_before_anything_starts(tmp_path: Path) -> None:
    from tracetrain.cli import serve

    config = Config(gateway_cpus="0", db_url=f"sqlite:///{tmp_path / 'tt.db'}")
    with pytest.raises(SystemExit, match="gateway_cpus with --train"):
        serve(config, train=True)
    assert not (tmp_path / "tt.db").exists(), "refused before the store was opened"
