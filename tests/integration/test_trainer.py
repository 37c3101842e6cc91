"""The trainer against a real store: leases, staleness and zero-variance accounting, resume."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlmodel import Session, select

from tests.support.sessions import add_session
from tracetrain.config import TrainConfig
from tracetrain.store import leases
from tracetrain.store.db import open_db
from tracetrain.store.models import AgentSession, Policy
from tracetrain.trainer.checkpoint import SHARDED_DIR, STATE_STAGING, build_model, load_sharded
from tracetrain.trainer.data import collate, load_samples
from tracetrain.trainer.devices import autocast
from tracetrain.trainer.loop import Trainer
from tracetrain.trainer.step import SampledLogits, sequence_logprobs


def test_two_trainers_never_claim_the_same_session(db_url: str) -> None:
    db = open_db(db_url)
    with Session(db) as s:
        for i in range(40):
            add_session(s, f"s{i}", "g", 1.0)
        s.commit()
    claimed: dict[str, list[str]] = {"a": [], "b": []}

    def claim(name: str) -> None:
        with Session(db) as s:
            while batch := leases.claim_sessions(s, trainer_id=name, limit=3, lease_s=60):
                claimed[name] += batch

    threads = [threading.Thread(target=claim, args=(n,)) for n in claimed]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not set(claimed["a"]) & set(claimed["b"])
    assert sorted(claimed["a"] + claimed["b"], key=lambda sid: int(sid[1:])) == [f"s{i}" for i in range(40)]


def test_an_expired_lease_goes_to_the_next_trainer(db_url: str) -> None:
    db = open_db(db_url)
    with Session(db) as s:
        add_session(s, "s1", "g", 1.0)
        s.commit()
        assert leases.claim_sessions(s, trainer_id="crashed", limit=5, lease_s=-1) == ["s1"]
        assert leases.claim_sessions(s, trainer_id="next", limit=5, lease_s=60) == ["s1"]
        assert leases.claim_sessions(s, trainer_id="third", limit=5, lease_s=60) == []


def _trainer(tiny_model_path: Path, tmp_path: Path, db_url: str, **overrides: object) -> Trainer:
    cfg = TrainConfig(**{"lora": False, "lr": 1e-3, "batch_sessions": 8, "min_sessions": 1,
                         "checkpoint_dir": tmp_path / "ckpt", "max_staleness": 1, **overrides})  # type: ignore[arg-type]
    return Trainer(cfg, open_db(db_url), tiny_model_path)


def test_stale_and_zero_variance_sessions_are_set_aside_and_counted(tiny_model_path: Path, tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 't.db'}"
    db = open_db(db_url)
    with Session(db) as s:
        s.add(Policy(version=3, checkpoint=None, kind="base"))  # the trainer starts at version 3
        add_session(s, "old", "g-old", 1.0, version=1)  # 2 versions behind: stale
        add_session(s, "flat-1", "g-flat", 1.0, version=3)
        add_session(s, "flat-2", "g-flat", 1.0, version=3)  # same reward in its group: zero variance
        add_session(s, "good-1", "g-good", 1.0, version=3)
        add_session(s, "good-2", "g-good", 0.0, version=2)
        s.commit()
    trainer = _trainer(tiny_model_path, tmp_path, db_url, flat_groups="set_aside")
    assert trainer.version == 3
    assert trainer.step_once()
    assert trainer.version == 4
    assert trainer.counts["stale"] == 1 and trainer.counts["zero_variance"] == 2 and trainer.counts["samples"] == 2
    with Session(db) as s:
        rows = {row.id: (row.trained_version, row.skip_reason) for row in s.exec(select(AgentSession)).all()}
        policy = s.get(Policy, ("default", 4))
    # set aside, not consumed: still in the store for offline algorithms and export
    assert rows == {"old": (None, "stale"), "flat-1": (None, "zero_variance"), "flat-2": (None, "zero_variance"),
                    "good-1": (4, None), "good-2": (4, None)}
    assert policy is not None and policy.metrics["samples"] == 2 and policy.metrics["stale"] == 1
    assert policy.metrics["set_aside"] == {"stale": 1, "zero_variance": 2}
    assert policy.metrics["staleness"] == {"0": 1, "1": 1} and policy.metrics["sessions"] == 2


def test_kept_flat_groups_are_trained_on_and_consumed(tiny_model_path: Path, tmp_path: Path) -> None:
    """`flat_groups: keep` (TRL's batches): an all-equal group is consumed by the step, with zero advantage."""
    db_url = f"sqlite:///{tmp_path / 't.db'}"
    db = open_db(db_url)
    with Session(db) as s:
        for sid, group, reward in (("flat-1", "g-flat", 1.0), ("flat-2", "g-flat", 1.0),
                                   ("good-1", "g-good", 1.0), ("good-2", "g-good", 0.0)):
            add_session(s, sid, group, reward)
        s.commit()
    trainer = _trainer(tiny_model_path, tmp_path, db_url, flat_groups="keep")
    assert trainer.step_once() and trainer.version == 1
    assert trainer.counts["zero_variance"] == 0 and trainer.counts["samples"] == 4
    with Session(db) as s:
        rows = {row.id: (row.trained_version, row.skip_reason) for row in s.exec(select(AgentSession)).all()}
        policy = s.get(Policy, ("default", 1))
    assert rows == {sid: (1, None) for sid in ("flat-1", "flat-2", "good-1", "good-2")}
    assert policy is not None and policy.metrics["sessions"] == 4 and not any(policy.metrics["set_aside"].values())


@pytest.mark.parametrize("lora", [False, True])
def test_trainer_resumes_from_its_last_checkpoint(tiny_model_path: Path, tmp_path: Path, lora: bool) -> None:
    db_url = f"sqlite:///{tmp_path / 't.db'}"
    db = open_db(db_url)
    with Session(db) as s:
        for i in range(4):
            add_session(s, f"a{i}", f"g{i // 2}", float(i % 2))
        s.commit()
    first = _trainer(tiny_model_path, tmp_path, db_url, lora=lora, lora_rank=8)
    assert first.step_once() and first.version == 1
    written = sorted(p.name for p in (tmp_path / "ckpt" / "v000001").iterdir())
    assert ("adapter_model.safetensors" in written) == lora and ("model.safetensors" in written) != lora
    model = first.backend.model  # type: ignore[attr-defined]
    first.close()  # its state may still be being written in the background
    saved = _sharded_model_keys(tmp_path / "ckpt" / "v000001" / SHARDED_DIR)
    assert {name for name, p in model.named_parameters() if p.requires_grad} <= saved
    # the frozen base stays out, its tied head too: it comes from the base model on load
    assert not saved & {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    again = _trainer(tiny_model_path, tmp_path, db_url, lora=lora, lora_rank=8)
    assert again.version == 1 and again.counts["steps"] == 1
    resumed = again.backend.model.state_dict()  # type: ignore[attr-defined]
    assert all(torch.equal(v, resumed[k]) for k, v in weights.items())
    assert again.backend.optimizer.state, "optimizer moments come back too"  # type: ignore[attr-defined]
    with Session(db) as s:
        for i in range(4):
            add_session(s, f"b{i}", f"h{i // 2}", float(i % 2), version=1)
        s.commit()
    assert again.step_once() and again.version == 2


def _add_batch(db_url: str, prefix: str, version: int) -> None:
    with Session(open_db(db_url)) as s:
        for i in range(4):
            add_session(s, f"{prefix}{i}", f"{prefix}-g{i // 2}", float(i % 2), version=version)
        s.commit()


def _trainable(model: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def test_a_versions_resume_state_holds_its_own_weights_though_the_next_step_ran(tiny_model_path: Path,
                                                                                tmp_path: Path) -> None:
    """The sharded state is written in the background while the next step trains: it must hold the weights
    and moments of the version it belongs to, not the next step's."""
    db_url = f"sqlite:///{tmp_path / 't.db'}"
    _add_batch(db_url, "a", 0)
    trainer = _trainer(tiny_model_path, tmp_path, db_url, lora=True, lora_rank=8, keep_checkpoints=5)
    assert trainer.step_once()
    model = trainer.backend.model  # type: ignore[attr-defined]
    first = _trainable(model)
    _add_batch(db_url, "b", 1)
    assert trainer.step_once() and trainer.version == 2
    second = _trainable(model)
    trainer.close()
    assert any(not torch.equal(first[k], second[k]) for k in first)

    cfg = TrainConfig(lora=True, lora_rank=8)
    fresh = build_model(tiny_model_path, cfg)
    optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-3)
    load_sharded(tmp_path / "ckpt" / "v000001" / SHARDED_DIR, fresh, optimizer)
    assert all(torch.equal(v, _trainable(fresh)[k]) for k, v in first.items())
    assert not list((tmp_path / "ckpt").glob("*.tmp")), "staging directories are renamed into place"


def test_a_version_without_its_resume_state_resumes_from_its_weights(tiny_model_path: Path, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A trainer stopped after its version's directory was in place but before the sharded state was: the
    next trainer goes on from that version's weights with fresh optimizer moments, and says so."""
    db_url = f"sqlite:///{tmp_path / 't.db'}"
    _add_batch(db_url, "a", 0)
    first = _trainer(tiny_model_path, tmp_path, db_url, lora=True, lora_rank=8)
    assert first.step_once()
    weights = _trainable(first.backend.model)  # type: ignore[attr-defined]
    first.close()
    version = tmp_path / "ckpt" / "v000001"
    # as the stop leaves it: the state half written beside the version, none inside it
    (version / SHARDED_DIR).rename(version.with_name(version.name + STATE_STAGING))

    again = _trainer(tiny_model_path, tmp_path, db_url, lora=True, lora_rank=8)
    assert again.version == 1
    assert all(torch.equal(v, _trainable(again.backend.model)[k]) for k, v in weights.items())  # type: ignore[attr-defined]
    assert not again.backend.optimizer.state  # type: ignore[attr-defined]
    assert "fresh optimizer moments" in caplog.text
    _add_batch(db_url, "b", 1)
    assert again.step_once() and again.version == 2
    again.close()
    assert (tmp_path / "ckpt" / "v000002" / SHARDED_DIR).is_dir()


def _sharded_model_keys(path: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k.removeprefix("model.") for k in keys if k.startswith("model.")}


def test_a_sharded_state_that_holds_the_frozen_head_still_loads(tiny_model_path: Path, tmp_path: Path) -> None:
    """Versions written before the frozen tied head was left out of the sharded state hold it; they resume."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    cfg = TrainConfig(lora=True, lora_rank=8)
    model = build_model(tiny_model_path, cfg)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sum(p.sum() for p in model.parameters() if p.requires_grad).backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    assert "base_model.model.lm_head.weight" in model_state  # what older versions wrote
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp_path / "old"), no_dist=True)

    fresh = build_model(tiny_model_path, cfg)
    fresh_optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-3)
    load_sharded(tmp_path / "old", fresh, fresh_optimizer)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in model.state_dict().items())
    assert len(fresh_optimizer.state) == len(optimizer.state)


@pytest.mark.parametrize(("dtype", "tolerance"), [
    ("float32", 1e-4),
    pytest.param("bfloat16", 0.05, marks=pytest.mark.skipif(
        not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no bfloat16 (tests/gpu/ checks it)")),
])
def test_trainer_logprobs_match_the_recorded_behaviour_logprobs(gateway: Any, tiny_model_path: Path,
                                                               dtype: str, tolerance: float) -> None:
    """Same weights, same tokens: the trainer's logprobs equal what the engine recorded (float32), so
    importance ratios start at 1. Tolerances per trainer dtype: float32 1e-4 (the same arithmetic in a
    different order); bfloat16 0.05 (its 8-bit mantissa puts a relative 2**-9 on every weight and
    activation; over this model's logits that moves a logprob by a few hundredths at most, and TIS
    absorbs such a ratio)."""
    from openai import OpenAI

    client = OpenAI(base_url=gateway.v1("lp-match"), api_key="unused")
    messages: list[Any] = [{"role": "user", "content": "hello"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=1.0, seed=3)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=1.0, seed=4)

    with Session(gateway.gateway.db) as db:
        (sample,) = load_samples(db, ["lp-match"])
    model = SampledLogits(build_model(tiny_model_path, TrainConfig(lora=False))).eval()
    micro = collate([sample], [0], pad_id=0)
    recorded = micro.behaviour_logprobs[micro.mask > 0]
    assert int(micro.mask.sum()) == 12
    with torch.no_grad(), autocast(TrainConfig(dtype=dtype), "cpu"):
        logprobs, _ = sequence_logprobs(model, micro)
    difference = torch.max(torch.abs(logprobs[micro.mask > 0] - recorded)).item()
    print(f"trainer {dtype} vs engine float32: max |logprob difference| {difference:.2g}")
    assert difference < tolerance


def test_lora_checkpoints_can_carry_merged_full_weights(tiny_model_path: Path, tmp_path: Path) -> None:
    """LoRA training served as full weights: the merged model computes what base + adapter computes."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    db_url = f"sqlite:///{tmp_path / 't.db'}"
    with Session(open_db(db_url)) as db:
        for i in range(4):
            add_session(db, f"m{i}", f"g{i // 2}", float(i % 2))
        db.commit()
    published: list[tuple[int, Path, str]] = []
    cfg = TrainConfig(lr=1e-2, batch_sessions=8, min_sessions=1, checkpoint_dir=tmp_path / "ckpt", lora=True,
                      lora_rank=8, publish="reload")
    trainer = Trainer(cfg, open_db(db_url), tiny_model_path,
                      publish=lambda v, p, k, weights=None: published.append((v, p, k)))
    assert trainer.step_once()
    ((version, path, kind),) = published
    assert (version, kind, path.name) == (1, "full", "merged")
    with safe_open(str(path / "model.safetensors"), "pt") as merged, \
            safe_open(str(tiny_model_path / "model.safetensors"), "pt") as base:
        assert set(merged.keys()) == set(base.keys())
    ids = torch.tensor([[1, 4093, 198, 6004, 2, 28, 29]])
    with torch.no_grad():
        expected = trainer.backend.model(input_ids=ids).logits  # type: ignore[attr-defined]
        actual = AutoModelForCausalLM.from_pretrained(str(path))(input_ids=ids).logits
    assert torch.allclose(expected, actual, atol=1e-4)


def test_a_checkpoint_of_another_model_is_refused_before_any_weights_load(tiny_model_path: Path,
                                                                          tmp_path: Path) -> None:
    from tracetrain.engines.models import tiny_model_dir

    db_url = f"sqlite:///{tmp_path / 't.db'}"
    with Session(open_db(db_url)) as db:
        for i in range(2):
            add_session(db, f"a{i}", "g", float(i))
        db.commit()
    assert _trainer(tiny_model_path, tmp_path, db_url).step_once()
    other = tiny_model_dir(hidden=32)
    with pytest.raises(ValueError, match=r"trained from another model .*hidden_size: 64 there, 32 here"):
        _trainer(other, tmp_path, db_url)


def test_past_successes_are_trained_on_again_until_they_age_out(tiny_model_path: Path, tmp_path: Path) -> None:
    """`train.replay_successes`: each step trains on its batch plus earlier samples that did better than
    expected, for `replay_max_age` versions; the version's figures say how many were replayed."""
    db_url = f"sqlite:///{tmp_path / 't.db'}"
    trainer = _trainer(tiny_model_path, tmp_path, db_url, batch_sessions=4, min_sessions=4, max_staleness=0,
                       replay_successes=8, replay_max_age=1)
    replayed = []
    for version, prefix in enumerate("abc"):
        _add_batch(db_url, prefix, version)  # two groups of a failure and a success: two successes kept
        assert trainer.step_once() and trainer.version == version + 1
        with Session(open_db(db_url)) as s:
            policy = s.get(Policy, ("default", version + 1))
        assert policy is not None and policy.metrics["samples"] == 4  # the fresh ones, as before
        replayed.append(policy.metrics["replayed"])
    # v1: nothing yet; v2: a's two successes; v3: b's two (a's are 2 versions old, past the limit of 1)
    assert replayed == [0, 2, 2]
    assert [k.sample.session_id for k in trainer.lines["default"].replay.kept] == ["b1", "b3", "c1", "c3"]  # type: ignore[union-attr]

    # A restarted trainer replays the same successes: its resume state names them, the store holds them.
    trainer.close()
    restarted = _trainer(tiny_model_path, tmp_path, db_url, batch_sessions=4, min_sessions=4, max_staleness=0,
                         replay_successes=8, replay_max_age=1)
    kept = restarted.lines["default"].replay.kept  # type: ignore[union-attr]
    assert [(k.sample.session_id, k.version, k.sample.reward) for k in kept] == \
        [("b1", 1, 1.0), ("b3", 1, 1.0), ("c1", 2, 1.0), ("c3", 2, 1.0)]


def test_a_batch_of_stale_sessions_is_reported_with_the_setting_that_keeps_them(
        tiny_model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rewards that come more versions late than `train.max_staleness` are thrown away unseen; when a
    whole batch's worth goes that way, the trainer says so and names the setting."""
    db_url = f"sqlite:///{tmp_path / 't.db'}"
    with Session(open_db(db_url)) as s:
        s.add(Policy(version=5, checkpoint=None, kind="base"))
        s.commit()
    _add_batch(db_url, "late", 1)  # 4 sessions sampled by version 1, rewarded now: 4 versions late
    _add_batch(db_url, "now", 5)
    trainer = _trainer(tiny_model_path, tmp_path, db_url, batch_sessions=4, min_sessions=4)
    with caplog.at_level("WARNING", logger="tracetrain.trainer.loop"):
        assert trainer.step_once()
    assert trainer.counts["stale"] == 4 and trainer.counts["samples"] == 4
    (warning,) = _trainer_warnings(caplog)
    assert "4 sessions set aside as stale" in warning and "train.max_staleness=1" in warning

    caplog.clear()
    bounded = f"sqlite:///{tmp_path / 'u.db'}"
    with Session(open_db(bounded)) as s:
        s.add(Policy(version=5, checkpoint=None, kind="base"))
        s.commit()
    _add_batch(bounded, "late", 1)
    again = _trainer(tiny_model_path, tmp_path / "bounded", bounded, batch_sessions=4, min_sessions=4, max_staleness=4)
    with caplog.at_level("WARNING", logger="tracetrain.trainer.loop"):
        assert again.step_once()  # within the bound: trained on, nothing to report
    assert again.counts["stale"] == 0 and not _trainer_warnings(caplog)


def _trainer_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "tracetrain.trainer.loop" and r.levelname == "WARNING"]
