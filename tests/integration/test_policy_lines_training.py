"""One trainer, several named policies (docs/architecture.md, decision 13): each line trains only on its own
sessions, numbers its own versions, keeps its own checkpoints and settings, and resumes after a restart, on
one base model with an adapter and an optimizer per policy."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import PeftModel
from sqlmodel import Session, select
from transformers import AutoModelForCausalLM

from tests.support.sessions import add_session
from tracetrain.config import TrainConfig
from tracetrain.engines.probe import read_probe
from tracetrain.store import leases, policy_lines, promotion, queries
from tracetrain.store.db import open_db
from tracetrain.store.models import DEFAULT_POLICY, AgentSession, Policy
from tracetrain.trainer.batch import Batch
from tracetrain.trainer.local_backend import LocalBackend
from tracetrain.trainer.loop import POLICIES_DIR, Line, Trainer


def _cfg(tmp_path: Path, **overrides: object) -> TrainConfig:
    return TrainConfig(**{"lora": True, "lora_rank": 4, "publish": "lora", "lr": 1e-3, "batch_sessions": 4,
                          "min_sessions": 4, "checkpoint_dir": tmp_path / "ckpt", "max_staleness": 2,
                          "group_settle_s": 0, **overrides})  # type: ignore[arg-type]


def _add(db_url: str, policy: str, prefix: str, groups: int, version: int = 0) -> None:
    """`groups` groups of two sessions with different rewards (a signal), of named policy `policy`."""
    with Session(open_db(db_url)) as s:
        for g in range(groups):
            for i, reward in enumerate((0.0, 1.0)):
                add_session(s, f"{prefix}-{g}-{i}", f"{prefix}-g{g}", reward, version=version, policy=policy)
        s.commit()


def test_versions_are_numbered_per_line_and_the_default_line_reads_as_before(db_url: str) -> None:
    db = open_db(db_url)
    with Session(db) as s:
        policy_lines.create(s, name="support", training="lora", settings={})
        s.add(Policy(version=1, checkpoint="/d1", kind="lora", published_at=promotion.utcnow(), promotion="immediate"))
        s.add(Policy(line="support", version=1, checkpoint="/s1", kind="lora", published_at=promotion.utcnow(),
                     promotion="immediate"))
        s.add(Policy(line="support", version=2, checkpoint="/s2", kind="lora"))
        s.commit()
        latest, support = leases.latest_policy(s), leases.latest_policy(s, line="support")
        assert latest is not None and (latest.line, latest.version) == (DEFAULT_POLICY, 1)
        assert support is not None and (support.line, support.version) == ("support", 2)
        assert leases.latest_policy(s, line="nobody") is None, "a line with no versions is at its base model"
        published = queries.latest_published(s, line="support")
        assert published is not None and published.checkpoint == "/s1"
        incumbent = promotion.incumbent(s)
        assert incumbent is not None and incumbent.checkpoint == "/d1", "the default line's incumbent only"
        assert [(p.line, p.version) for p in queries.list_policies(s)] == [
            (DEFAULT_POLICY, 0), (DEFAULT_POLICY, 1), ("support", 1), ("support", 2)]
        assert [p.version for p in queries.list_policies(s, line="support")] == [1, 2]
        promotion.mark_published(s, line="support", version=2, checkpoint=Path("/s2"), kind="lora",
                                 promotion="immediate")
        row = promotion.version_row(s, line="support", version=2)
        assert row is not None and row.promotion == "immediate" and row.published_at is not None
        assert {k: v.version for k, v in queries.latest_published_by_line(s).items()} == {
            DEFAULT_POLICY: 1, "support": 2}


def test_each_policy_trains_on_its_own_sessions_with_its_own_versions_and_settings(
        tiny_model_path: Path, tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 't.db'}"
    db = open_db(db_url)
    with Session(db) as s:
        policy_lines.create(s, name="support", training="lora", settings={"lr": 0.05, "batch_sessions": 2,
                                                                          "min_sessions": 2, "retention_days": 3})
        policy_lines.create(s, name="coding.v2", training="lora", settings={})
    _add(db_url, DEFAULT_POLICY, "d", 2)
    _add(db_url, "support", "s", 1)
    _add(db_url, "coding.v2", "c", 2)
    published: list[tuple[str, int, Path]] = []
    trainer = Trainer(_cfg(tmp_path), db, tiny_model_path,
                      publish=lambda v, p, k, weights=None: published.append((DEFAULT_POLICY, v, p)),
                      publish_line=lambda line, v, p: published.append((line, v, p)))
    assert set(trainer.lines) == {DEFAULT_POLICY, "support", "coding.v2"}
    backend = trainer.backend
    assert isinstance(backend, LocalBackend)
    assert backend.lines["support"][1].param_groups[0]["lr"] == 0.05, "the policy's own lr"
    assert backend.lines["coding.v2"][1].param_groups[0]["lr"] == 1e-3
    # One base model: every line's adapter is in one PEFT model, each with an optimizer over its own adapter.
    assert set(backend.model.peft_config) == {"default", "policy-support", "policy-coding:v2"}
    owned = {name: {id(p) for g in opt.param_groups for p in g["params"]} for name, (_, opt) in backend.lines.items()}
    assert all(not (owned[a] & owned[b]) for a in owned for b in owned if a != b)

    steps = [trainer.step_once() for _ in range(4)]
    assert steps == [True, True, True, False], "three lines with a batch each, then none ready"
    assert {name: line.version for name, line in trainer.lines.items()} == {
        DEFAULT_POLICY: 1, "support": 1, "coding.v2": 1}
    assert sorted((line, v) for line, v, _ in published) == [("coding.v2", 1), (DEFAULT_POLICY, 1), ("support", 1)]
    with Session(db) as s:
        trained = {(row.policy, row.trained_version) for row in s.exec(select(AgentSession)).all()}
        assert trained == {(DEFAULT_POLICY, 1), ("support", 1), ("coding.v2", 1)}
        versions = {(p.line, p.version): p for p in queries.list_policies(s)}
        assert set(versions) == {(DEFAULT_POLICY, 0), (DEFAULT_POLICY, 1), ("support", 1), ("coding.v2", 1)}
        assert versions[("support", 1)].metrics["sessions"] == 2 and versions[("coding.v2", 1)].metrics[
            "sessions"] == 4
        assert versions[("support", 1)].published_at is not None
    root = tmp_path / "ckpt"
    assert (root / "v000001" / "adapter_config.json").is_file(), "the default line's checkpoints stay where they were"
    for name in ("support", "coding.v2"):
        adapter = root / POLICIES_DIR / name / "v000001"
        assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
        assert not (root / "v000001" / name).exists(), "the default line's checkpoint holds its own adapter only"
        # The adapter on its own, on the base model, is what the trainer trained: its probe's logprobs.
        probe = read_probe(adapter)
        assert probe is not None
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_path)), str(adapter))
        with torch.no_grad():
            ids = torch.tensor([probe.token_ids])
            logprobs = model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        assert torch.allclose(logprobs, torch.tensor(probe.logprobs), atol=1e-4)

    # New sessions of one line step only that line; its staleness is counted in its own versions.
    _add(db_url, "support", "s2", 1, version=1)
    _add(db_url, "support", "s-old", 1, version=0)
    assert trainer.step_once() and trainer.lines["support"].version == 2
    assert trainer.lines["support"].counts["stale"] == 0, "version 0 is within max_staleness 2 of support's 1"
    assert trainer.version == 1 and trainer.lines["coding.v2"].version == 1
    trainer.close()

    restarted = Trainer(_cfg(tmp_path), db, tiny_model_path)
    assert {name: line.version for name, line in restarted.lines.items()} == {
        DEFAULT_POLICY: 1, "support": 2, "coding.v2": 1}
    assert restarted.lines["support"].resume == (root / POLICIES_DIR / "support" / "v000002").resolve()
    assert restarted.lines["support"].counts["steps"] == 2, "its own totals, from its own checkpoint"
    restarted.close()


def test_a_session_of_one_policy_never_lands_in_a_batch_of_another(tiny_model_path: Path, tmp_path: Path) -> None:
    """A busy policy with far more ready sessions than a batch, and a quiet one: every version's sessions are
    of its own line, and each line's batches hold its sessions only."""
    db_url = f"sqlite:///{tmp_path / 't.db'}"
    db = open_db(db_url)
    with Session(db) as s:
        policy_lines.create(s, name="a", training="lora", settings={})
        policy_lines.create(s, name="b", training="lora", settings={})
    _add(db_url, "a", "a", 10)
    _add(db_url, "b", "b", 2)
    trainer = Trainer(_cfg(tmp_path, max_staleness=10), db, tiny_model_path)
    batches: list[tuple[str, list[str]]] = []
    step = trainer._step

    def watched(line: Line, batch: Batch) -> bool:
        batches.append((line.name, list(batch.session_ids)))
        return step(line, batch)

    trainer._step = watched  # type: ignore[method-assign]
    while trainer.step_once():
        pass
    trainer.close()
    assert [name for name, _ in batches] == ["a", "b", "a", "a", "a", "a"], "fair turns, then the busy line alone"
    with Session(db) as s:
        policy_of = {row.id: row.policy for row in s.exec(select(AgentSession)).all()}
        assert all(row.trained_version is not None for row in s.exec(select(AgentSession)).all())
    for name, ids in batches:
        assert ids and {policy_of[i] for i in ids} == {name}
    assert trainer.lines["a"].version == 5 and trainer.lines["b"].version == 1
