"""The trainer under canary promotion: it waits for its canary's decision, and after a rollback it trains
on from the incumbent's weights (the base model here), never from the rolled-back ones, also after a
restart; the rolled-back version's sessions are set aside, not trained on."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
from sqlmodel import Session
from transformers import AutoModelForCausalLM

from tests.support.sessions import add_session
from tracetrain.config import DEFAULT_POLICY, TrainConfig
from tracetrain.store import policy_lines, promotion
from tracetrain.store.db import open_db
from tracetrain.store.models import AgentSession
from tracetrain.trainer.local_backend import LocalBackend, adapter_name
from tracetrain.trainer.loop import Trainer


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    model = trainer.backend.model  # type: ignore[attr-defined]  # the local backend's model
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in b)


def test_the_trainer_waits_for_its_canary_and_continues_from_the_promoted_line(tiny_model_path: Path,
                                                                              tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 't.db'}"
    db = open_db(db_url)

    def add_group(name: str, version: int) -> None:
        with Session(db) as s:
            for i, reward in enumerate((1.0, 0.0, 1.0, 0.0)):
                add_session(s, f"{name}-{i}", name, reward, version=version)
            s.commit()

    # what the gateway records under `canary`
    def as_canary(version: int, path: Path, kind: str, *, weights: object = None) -> None:
        with Session(db) as s:
            promotion.mark_published(s, version=version, checkpoint=path, kind=kind, promotion="canary")

    cfg = TrainConfig(lora=False, lr=1e-2, batch_sessions=4, min_sessions=1, max_staleness=2,
                      checkpoint_dir=tmp_path / "ckpt")
    trainer = Trainer(cfg, db, tiny_model_path, publish=as_canary)
    base_model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path))
    base = {k: v.detach().clone() for k, v in base_model.state_dict().items()}
    add_group("g1", 0)
    assert trainer.step_once() and trainer.version == 1
    assert not _same(_weights(trainer), base)

    add_group("g2", 0)
    add_group("on-v1", 1)  # sessions the canary served
    assert not trainer.step_once()  # version 1 is on trial: no step
    with Session(db) as s:
        assert promotion.decide(s, version=1, outcome="rolled_back", decision={"by": "test"})
        assert not promotion.decide(s, version=1, outcome="promoted", decision={})  # decided once only
        set_aside = {x.id: x.skip_reason for x in (s.get(AgentSession, f"on-v1-{i}") for i in range(4)) if x}
    assert set(set_aside.values()) == {"rolled_back"}

    assert trainer.follow_promotion()
    assert trainer.line is None and _same(_weights(trainer), base)  # back on the base model's weights
    assert trainer.step_once() and trainer.version == 2  # numbering goes on
    with Session(db) as s:
        trained = {x.id: x.trained_version for x in (s.get(AgentSession, f"{g}-{i}") for g in ("g2", "on-v1")
                                                       for i in range(4)) if x}
    assert all(trained[f"g2-{i}"] == 2 for i in range(4)) and all(trained[f"on-v1-{i}"] is None for i in range(4))

    # Version 2 promoted, version 3 rolled back: a restarted trainer numbers from 3 with version 2's weights.
    with Session(db) as s:
        assert promotion.decide(s, version=2, outcome="promoted", decision={"by": "test"})
    line = trainer.line
    v2 = _weights(trainer)
    add_group("g3", 2)
    assert trainer.step_once() and trainer.version == 3
    with Session(db) as s:
        assert promotion.decide(s, version=3, outcome="rolled_back", decision={"by": "test"})
    trainer.close()
    restarted = Trainer(cfg, db, tiny_model_path, publish=as_canary)
    assert restarted.version == 3 and restarted.line == line
    assert _same(_weights(restarted), v2)
    assert line is not None and line.exists()  # kept while it is the line, whatever keep_checkpoints says
    restarted.close()


def test_a_named_policys_rollback_moves_only_its_own_line_back(tiny_model_path: Path, tmp_path: Path) -> None:
    """A named policy's version on trial holds only that line's steps; rolled back, that line's adapter starts
    again from its incumbent (the base model: a fresh adapter), and the default line keeps what it learned."""
    db = open_db(f"sqlite:///{tmp_path / 't.db'}")
    with Session(db) as s:
        policy_lines.create(s, name="support", training="lora", settings={})

    def add_group(name: str, version: int, policy: str) -> None:
        with Session(db) as s:
            for i, reward in enumerate((1.0, 0.0, 1.0, 0.0)):
                add_session(s, f"{name}-{i}", name, reward, version=version, policy=policy)
            s.commit()

    def as_canary(line: str, version: int, path: Path) -> None:  # what the gateway records under `canary`
        with Session(db) as s:
            promotion.mark_published(s, version=version, checkpoint=path, kind="lora", promotion="canary", line=line)

    cfg = TrainConfig(lora=True, lora_rank=4, publish="lora", lr=5e-2, batch_sessions=4, min_sessions=1,
                      max_staleness=2, group_settle_s=0, checkpoint_dir=tmp_path / "ckpt")
    trainer = Trainer(cfg, db, tiny_model_path, publish=lambda v, p, k, weights=None: as_canary(DEFAULT_POLICY, v, p),
                      publish_line=as_canary)
    backend = trainer.backend
    assert isinstance(backend, LocalBackend)

    def adapter(name: str) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in backend.model.state_dict().items() if f".{name}." in k}

    add_group("s1", 0, "support")
    add_group("d1", 0, DEFAULT_POLICY)
    assert trainer.step_once() and trainer.step_once()
    assert {n: line.version for n, line in trainer.lines.items()} == {DEFAULT_POLICY: 1, "support": 1}
    add_group("s2", 0, "support")
    assert not trainer.step_once(), "both lines' versions are on trial"
    with Session(db) as s:
        assert promotion.decide(s, version=1, outcome="promoted", decision={"by": "test"})
        assert promotion.decide(s, version=1, outcome="rolled_back", decision={"by": "test"}, line="support")
        assert not promotion.decide(s, version=1, outcome="promoted", decision={}, line="support")
    default_v1, support_v1 = adapter(adapter_name(DEFAULT_POLICY)), adapter(adapter_name("support"))
    assert any(v.abs().sum() > 0 for k, v in support_v1.items() if "lora_B" in k)
    assert trainer.follow_promotion(name="support")
    backend = cast(LocalBackend, trainer.backend)
    # Support's adapter starts again fresh (B at zero: the base model); the default line's is still version 1's.
    assert trainer.lines["support"].resume is None
    assert all(v.abs().sum() == 0 for k, v in adapter(adapter_name("support")).items() if "lora_B" in k)
    assert _same(adapter(adapter_name(DEFAULT_POLICY)), default_v1)
    assert trainer.step_once() and trainer.lines["support"].version == 2, "numbering goes on"
    with Session(db) as s:
        trained = {x.id: x.trained_version for x in (s.get(AgentSession, f"s2-{i}") for i in range(4)) if x}
    assert set(trained.values()) == {2}
    trainer.close()
