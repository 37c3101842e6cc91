"""One config object: defaults < YAML < TRACETRAIN_ environment < CLI flags; loopback-only without keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from tracetrain.config import (
    DEFAULT_POLICY,
    Config,
    TrainConfig,
    load_config,
    parse_set,
    policy_problem,
)
from tracetrain.engines.vllm_server import VLLMServer
from tracetrain.store import models as store_models


def test_precedence_yaml_env_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tt.yaml"
    path.write_text("gateway: {port: 9000, reward_weights: {a: 2}}\nengine: {kind: transformers}\n"
                    "store: {url: sqlite:///from-yaml.db}\n")
    monkeypatch.setenv("TRACETRAIN_GATEWAY__PORT", "9100")
    monkeypatch.setenv("TRACETRAIN_GATEWAY__API_KEYS", '["k1", "k2"]')
    config = load_config(path, store={"url": "sqlite:///from-flag.db"})
    assert config.gateway.port == 9100
    assert config.engine.kind == "transformers"
    assert config.store.url == "sqlite:///from-flag.db"
    assert config.gateway.api_keys == ["k1", "k2"]
    assert config.gateway.reward_weights == {"a": 2.0}


def test_unknown_yaml_keys_are_errors(tmp_path: Path) -> None:
    path = tmp_path / "tt.yaml"
    path.write_text("prot: 9000\n")
    with pytest.raises(ValueError, match="prot"):
        load_config(path)
    path.write_text("gateway: {prot: 9000}\ntrain: {lrr: 0.1}\n")
    with pytest.raises(ValueError, match=r"gateway\.prot(.|\n)*train\.lrr"):
        load_config(path)


@pytest.mark.parametrize(("yaml_text", "words"), [
    ("db_url: sqlite:///x.db\n", r"db_url is now store\.url \(in YAML under `store:`, TRACETRAIN_STORE__URL"),
    ("engine: vllm\n", r"engine is now engine\.kind"),
    ("promotion: canary\ncanary_share: 0.5\n", r"promotion is now promotion\.mode.*canary_share is now "
                                                r"promotion\.canary_share"),
])
def test_old_flat_names_in_yaml_are_refused_with_their_new_place(tmp_path: Path, yaml_text: str, words: str) -> None:
    path = tmp_path / "tt.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValidationError, match=words):
        load_config(path)


@pytest.mark.parametrize(("name", "value", "words"), [
    ("TRACETRAIN_ENGINE_URL", "http://a:8000", r"engine_url is now engine\.urls .*TRACETRAIN_ENGINE__URLS"),
    ("TRACETRAIN_DB_URL", "sqlite:///x.db", r"db_url is now store\.url"),
    ("TRACETRAIN_ENGINE", "vllm", r"engine is now engine\.kind .*TRACETRAIN_ENGINE__KIND"),
    ("TRACETRAIN_PROMOTION", "canary", r"promotion is now promotion\.mode"),
])
def test_old_flat_environment_variables_are_refused_with_their_new_name(monkeypatch: pytest.MonkeyPatch, name: str,
                                                                        value: str, words: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match=words):
        load_config()


def test_vllm_python_stays_the_variable_that_finds_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """`TRACETRAIN_VLLM_PYTHON` is also read on its own (engines/vllm_server.py), so it is not an old name."""
    monkeypatch.setenv("TRACETRAIN_VLLM_PYTHON", "/nonexistent/python")
    assert load_config().engine.vllm_python is None


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_loopback_runs_without_keys(host: str) -> None:
    Config(gateway={"host": host}).gateway.check_access()


def test_other_addresses_need_keys() -> None:
    with pytest.raises(SystemExit, match="gateway.api_keys"):
        Config(gateway={"host": "0.0.0.0"}).gateway.check_access()
    with pytest.raises(SystemExit):
        Config(gateway={"host": "0.0.0.0", "api_keys": ["k"]}).gateway.check_access()
    Config(gateway={"host": "0.0.0.0", "api_keys": ["k"], "admin_key": "a"}).gateway.check_access()


def test_nested_train_settings_merge_across_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tt.yaml"
    path.write_text("train:\n  advantage: grpo\n  lr: 0.001\n  batch_sessions: 24\n")
    monkeypatch.setenv("TRACETRAIN_TRAIN__MAX_STALENESS", "5")
    monkeypatch.setenv("TRACETRAIN_TRAIN__BATCH_SESSIONS", "20")
    monkeypatch.setenv("TRACETRAIN_ENGINE__KIND", "transformers")
    config = load_config(path, **parse_set(["train.lr=1e-4", "lora=false", "gateway.admission=staleness",
                                            "engine.served_model_name=tiny"]))
    assert (config.train.advantage, config.train.lr, config.train.lora, config.train.max_staleness) == \
        ("grpo", 1e-4, False, 5)
    assert config.train.batch_sessions == 20 and config.gateway.admission == "staleness"
    assert (config.engine.kind, config.engine.served_model_name) == ("transformers", "tiny")


def test_set_takes_the_same_keys_everywhere_and_refuses_unknown_ones() -> None:
    config = Config(**parse_set(["lr=1e-4", "train.lora=false", "gateway.port=9001", "promotion.margin=0.1"]))
    assert (config.train.lr, config.train.lora, config.gateway.port, config.promotion.margin) == \
        (1e-4, False, 9001, 0.1)
    for bad in ("nosuch=1", "train.nosuch=1", "train", "db.url=x", "train.lr.x=1", "engine=vllm",
                "gateway={port: 1}"):
        with pytest.raises(SystemExit, match="no such setting|KEY=VALUE|is now"):
            parse_set([bad])
    # a bare name only the trainer has is the trainer's, even where another group has it too
    assert parse_set(["workers=2", "gpus=1"]) == {"train": {"workers": 2, "gpus": 1}}
    with pytest.raises(SystemExit, match=r"--set port: .*port is now gateway\.port"):
        parse_set(["port=9001"])


def test_batch_and_admission_combinations_are_checked_when_the_config_loads() -> None:
    with pytest.raises(ValidationError, match="min_sessions"):
        Config(train={"batch_sessions": 8, "min_sessions": 9})
    # the trainer takes the freshest first: beyond max_staleness + 1 batches, admitted work can only go stale
    with pytest.raises(ValidationError, match="gateway.admission_batches"):
        Config(gateway={"admission": "staleness", "admission_batches": 3}, train={"max_staleness": 1})
    assert Config(gateway={"admission": "staleness", "admission_batches": 1.5},
                  train={"batch_sessions": 32}).admission_limit == 48
    with pytest.raises(ValidationError, match="admission"):
        Config(gateway={"admission": "fifo"})


def test_publish_overlap_is_refused_where_it_cannot_hold() -> None:
    assert Config(train={"publish_overlap": True}).train.publish_overlap
    with pytest.raises(ValidationError, match="mode: sync"):
        Config(train={"publish_overlap": True, "mode": "sync"})
    with pytest.raises(ValidationError, match="canary"):
        Config(train={"publish_overlap": True}, promotion={"mode": "canary"})
    with pytest.raises(ValidationError, match="keep_checkpoints"):
        Config(train={"publish_overlap": True, "keep_checkpoints": 1})


def test_admission_auto_holds_agents_only_for_an_async_trainer_in_this_gateway() -> None:
    def resolved(mode: str, training_here: bool) -> str:
        return Config(**parse_set([f"mode={mode}"])).settled(training_here=training_here).gateway.admission

    assert resolved("async", True) == "staleness"
    assert resolved("sync", True) == "none"  # the sync hold already bounds staleness
    assert resolved("async", False) == "none"  # `serve` alone: no trainer here to wait for
    explicit = Config(**parse_set(["gateway.admission=none"])).settled(training_here=True)
    assert explicit.gateway.admission == "none"


def test_full_weights_go_from_memory_only_where_the_trainer_and_vllm_share_this_process_and_machine() -> None:
    """`train.weight_transfer: auto` on this machine (no GPU): the checkpoint on disk, which vLLM on the CPU
    reads back faster than shared memory brings it; `shm` only when asked for."""
    def resolved(*settings: str, training_here: bool = True) -> str:
        config = Config(**parse_set(["engine.kind=vllm", *settings]))
        return config.settled(training_here=training_here).train.weight_transfer

    assert resolved() == "disk"
    assert resolved(training_here=False) == "disk"  # `serve`: the trainer is another process
    assert resolved("engine.urls=http://127.0.0.1:9") == "disk"  # vLLM started by someone else
    assert resolved("lora=true", "train.publish=lora") == "disk"  # adapters are loaded, not weights
    assert resolved("train.weight_transfer=disk") == "disk"
    assert resolved("engine.urls=http://127.0.0.1:9", "train.weight_transfer=shm") == "shm"  # as told
    assert resolved("train.backend=fsdp", "train.workers=2", "train.weight_transfer=shm") == "shm"


def test_vllm_on_the_cpu_keeps_its_own_defaults_unless_told() -> None:
    """32-token blocks on every core made the demo generate faster but learn less (docs/architecture.md, "vLLM
    on the CPU"): vLLM's own defaults stay unless a setting asks, and a block size vLLM's kernels cannot use is
    refused as the config loads."""
    def engine(*settings: str, mode: str = "sync") -> tuple[int | None, str]:
        settled = Config(**parse_set(["engine.kind=vllm", f"train.mode={mode}", *settings])).settled(training_here=True)
        return settled.engine.block_size, settled.engine.cpu_cores

    assert engine() == engine(mode="async") == (None, "vllm")
    assert engine("engine.block_size=32", "engine.cpu_cores=all") == (32, "all")
    with pytest.raises(ValidationError, match="multiple of 16"):
        Config(**parse_set(["engine.block_size=40"]))
    with pytest.raises(ValidationError, match="cpu_cores"):
        Config(**parse_set(["engine.cpu_cores=auto"]))
    assert VLLMServer("/models/m", python="python", block_size=32).command()[-2:] == ["--block-size", "32"]
    assert "--block-size" not in VLLMServer("/models/m", python="python").command()


def test_cuda_ipc_is_chosen_when_the_local_trainer_and_vllm_share_one_gpu() -> None:
    from tracetrain.engines.gpus import GPUPlan

    def chosen(plan: GPUPlan, *settings: str) -> str:
        return Config(**parse_set(["engine.kind=vllm", *settings])).memory_transfer(plan, training_here=True)

    assert chosen(GPUPlan(engine=[0], trainer=[0], memory_share=0.3, sleep=True)) == "ipc"
    assert chosen(GPUPlan(engine=[0], trainer=[1], memory_share=0.9, sleep=False)) == "disk"  # two GPUs
    assert chosen(GPUPlan(engine=[0], trainer=[0], memory_share=0.3, sleep=True), "train.backend=fsdp") == "disk"


def test_cuda_ipc_is_refused_for_weights_that_fsdp_workers_hold() -> None:
    with pytest.raises(ValueError, match="weight_transfer=ipc.*fsdp"):
        Config(**parse_set(["train.backend=fsdp", "train.weight_transfer=ipc"]))


def _autos(model: Any, prefix: str = "") -> list[str]:
    found = []
    for name, value in model:
        if isinstance(value, BaseModel):
            found += _autos(value, f"{name}.")
        elif value == "auto":
            found.append(prefix + name)
    return found


@pytest.mark.parametrize("training_here", [True, False])
@pytest.mark.parametrize("overrides", [{}, {"engine": {"kind": "vllm"}, "train": {"lora": True}},
                                       {"engine": {"kind": "transformers"}, "train": {"workers": 2}},
                                       {"engine": {"kind": "vllm"}, "gateway": {"workers": 2},
                                        "train": {"lora": True}}])
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
    vllm = {"kind": "vllm"}
    assert Config(engine=vllm, gateway={"workers": 2}, train={"lora": True}).publish_mode() == "lora"
    assert Config(engine=vllm, promotion={"mode": "canary"}, train={"lora": True}).publish_mode() == "lora"
    assert Config(engine=vllm, train={"lora": False}).publish_mode() == "reload"
    assert Config(engine={"kind": "transformers"}, train={"lora": True}).publish_mode() == "inprocess"
    assert Config(engine=vllm, train={"lora": True, "publish": "none"}).publish_mode() == "none"


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
    monkeypatch.setenv("TRACETRAIN_ENGINE__URLS", "http://a:8000,http://b:8000")
    assert load_config().engine.urls == ["http://a:8000", "http://b:8000"]
    monkeypatch.delenv("TRACETRAIN_ENGINE__URLS")
    (tmp_path / "c.yaml").write_text("engine:\n  urls: http://a:8000\n")
    assert load_config(tmp_path / "c.yaml").engine.urls == ["http://a:8000"]
    assert load_config(engine={"urls": ["http://x:1", "http://y:2"]}).engine.urls == ["http://x:1", "http://y:2"]
    for bad, words in (({"urls": ["http://a:1"], "replicas": 2}, "list every server"),
                       ({"kind": "transformers", "replicas": 2}, "engine.kind: vllm"),
                       ({"spill_at": 100}, "never spill")):
        with pytest.raises(ValidationError, match=words):
            load_config(engine=bad)


def test_several_gateway_workers_prefer_lora_and_refuse_what_one_process_decides() -> None:
    two = {"workers": 2}
    assert load_config(gateway=two).publish_mode() == "lora"  # `auto` with LoRA decides it
    # Full weights are reloaded in agreement between the processes (proxy/replica_sync.py).
    assert load_config(gateway=two, train={"publish": "reload"}).train.publish == "reload"
    assert not load_config(gateway=two, train={"lora": False}).train.lora
    for bad in ({"engine": {"kind": "transformers"}, "train": {"publish": "lora"}},
                {"promotion": {"mode": "canary"}, "engine": {"replicas": 2}, "train": {"publish": "reload"}}):
        with pytest.raises(ValidationError, match="gateway.workers > 1"):
            load_config(gateway=two, **bad)


def test_canary_promotion_needs_both_versions_in_the_engines() -> None:
    canary = {"mode": "canary"}
    assert Config(promotion=canary).publish_mode() == "lora"  # one vLLM: two adapters side by side
    with pytest.raises(ValueError, match="two or more vLLM replicas"):
        Config(promotion=canary, train={"publish": "reload"})
    two = Config(promotion=canary, engine={"replicas": 2}, train={"publish": "reload"})  # a replica each
    assert two.train.publish == "reload"
    assert Config(promotion=canary, engine={"kind": "transformers"},
                  train={"publish": "inprocess"}).promotion.mode == "canary"
    with pytest.raises(ValueError, match="promotion.max_sessions"):
        Config(promotion={"mode": "canary", "min_sessions": 50, "max_sessions": 20})


def test_gateway_cpus_take_lists_and_ranges_from_every_source(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Config(gateway={"cpus": "0"}).gateway.cpus == [0]
    assert Config(gateway={"cpus": [1, 0, 1]}).gateway.cpus == [0, 1]
    assert load_config(None, gateway={"cpus": "0-1"}).gateway.cpus == [0, 1]
    monkeypatch.setenv("TRACETRAIN_GATEWAY__CPUS", "1,0")
    assert load_config(None).gateway.cpus == [0, 1]


@pytest.mark.parametrize(("value", "words"), [
    ("two", "not a CPU number"), ("1-", "not a CPU number"), ("4096", "not available to this process"),
])
def test_gateway_cpus_that_cannot_be_pinned_are_refused_when_the_config_loads(value: str, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        Config(gateway={"cpus": value})


def test_gateway_cpus_refuse_an_in_process_engine() -> None:
    with pytest.raises(ValidationError, match="engine.kind: transformers generates in it"):
        Config(gateway={"cpus": "0"}, engine={"kind": "transformers"})


def test_gateway_cpus_with_train_are_refused_before_anything_starts(tmp_path: Path) -> None:
    from tracetrain.cli import serve

    config = Config(gateway={"cpus": "0"}, store={"url": f"sqlite:///{tmp_path / 'tt.db'}"})
    with pytest.raises(SystemExit, match="gateway.cpus with --train"):
        serve(config, train=True)
    assert not (tmp_path / "tt.db").exists(), "refused before the store was opened"


def test_policies_and_keys_bound_to_them_load_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "tt.yaml"
    path.write_text("gateway:\n  policies: [{name: support, settings: {lr: 1.0e-5, retention_days: 30}}, "
                    "{name: coding}]\n  api_keys: [plain, {key: sk-support, policy: support}]\n")
    config = load_config(path)
    assert [(p.name, p.training, p.settings) for p in config.gateway.policies] == [
        ("support", "lora", {"lr": 1e-5, "retention_days": 30}), ("coding", "lora", {})]
    assert config.gateway.policy_by_key() == {"sk-support": "support"}
    assert config.gateway.agent_keys() == ["plain", "sk-support"]
    assert store_models.DEFAULT_POLICY == DEFAULT_POLICY, "the config and the store name the default alike"


@pytest.mark.parametrize(("gateway", "engine", "words"), [
    ({"policies": [{"name": "a"}, {"name": "b"}, {"name": "c"}]}, {},
     r"declares 3 policies; with the default one that is 4 LoRA adapters, more than engine\.max_loras \(3\)"),
    ({"policies": [{"name": "a"}]}, {"max_loras": 1}, r"more than engine\.max_loras \(1\)"),
    ({"policies": [{"name": "a", "training": "full"}]}, {}, r"'full' training.*full-weight training would change the "
     r"base model under every other policy"),
    ({"policies": [{"name": "Support Team"}]}, {}, r"Policy name 'Support Team' is not valid: 1 to 64 characters"),
    ({"policies": [{"name": "a"}, {"name": "a"}]}, {}, r"a declared more than once"),
    ({"policies": [{"name": "default"}]}, {}, r"'default' always exists"),
    ({"policies": [{"name": "tiny"}]}, {"served_model_name": "tiny"}, r"'tiny' is engine\.served_model_name"),
    ({"policies": [{"name": "a", "settings": {"device": "cuda"}}]}, {}, r"sets device, which a policy cannot set"),
    ({"policies": [{"name": "a", "settings": {"lr": "fast"}}]}, {}, r"train settings that are not valid: lr:"),
    ({"policies": [{"name": "a", "settings": {"min_sessions": 64}}]}, {}, r"train settings that are not valid"),
    ({"policies": [{"name": "a", "settings": {"retention_days": 0}}]}, {}, r"retention_days must be a whole number"),
    ({"api_keys": [{"key": "k", "policy": "nowhere"}]}, {}, r"bound to policy 'nowhere', which gateway\.policies "
     r"does not declare"),
])
def test_policies_that_cannot_work_are_refused_with_a_sentence_at_load(gateway: dict[str, Any],
                                                                        engine: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        load_config(gateway=gateway, engine=engine)


def test_policies_up_to_the_adapter_limit_load_and_the_api_shares_the_check() -> None:
    config = load_config(gateway={"policies": [{"name": "a"}, {"name": "b"}]}, engine={"max_loras": 3})
    assert [p.name for p in config.gateway.policies] == ["a", "b"]
    assert policy_problem("a", "lora", {"lr": 1e-5, "retention_days": None}) is None
    # Settings are checked on top of the config's trainer: min_sessions 16 fits a batch of 32, not one of 8.
    assert policy_problem("a", "lora", {"min_sessions": 16}) is None
    assert "min_sessions" in (policy_problem("a", "lora", {"min_sessions": 16}, TrainConfig(batch_sessions=8)) or "")


@pytest.mark.parametrize(("train", "words"), [
    ({"backend": "fsdp"}, r"train\.backend: fsdp: the fsdp backend trains the default policy's line only"),
    ({"workers": 2}, r"train\.backend: fsdp"),
    ({"lora": False}, r"train\.lora: false: the default policy would train the base model's full weights"),
    ({"publish": "reload"}, r"train\.publish: reload: merged full weights"),
])
def test_named_policies_need_one_local_lora_trainer(train: dict[str, Any], words: str) -> None:
    """Each policy trains an adapter of one base model in one process: what cannot do that is refused at load."""
    with pytest.raises(ValidationError, match=words):
        load_config(gateway={"policies": [{"name": "a"}]}, train=train)
    load_config(train=train)  # without named policies, each is fine


def test_named_policies_publish_adapters_to_vllm() -> None:
    assert load_config(gateway={"policies": [{"name": "a"}]}, engine={"kind": "vllm"}).publish_mode() == "lora"
