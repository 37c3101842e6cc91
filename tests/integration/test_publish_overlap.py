"""`train.publish_overlap`: each version is published on the trainer's publishing thread while the next step
gathers and trains, in order, and closing the trainer waits for the last publish.

The publish is a real hand-over function that takes a while (as loading into vLLM and scoring the probe
does) and notes when it ran; the trainer, the store and the checkpoints are real."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sqlmodel import Session

from tests.support.sessions import add_session
from tracetrain.config import TrainConfig
from tracetrain.store import queries
from tracetrain.store.db import open_db
from tracetrain.trainer.loop import Trainer

PUBLISH_S = 1.5


def test_versions_publish_in_order_while_the_next_step_trains(tiny_model_path: Path, tmp_path: Path) -> None:
    db = open_db(f"sqlite:///{tmp_path / 't.db'}")

    def add_group(name: str) -> None:
        with Session(db) as s:
            for i, reward in enumerate((1.0, 0.0, 1.0, 0.0)):
                add_session(s, f"{name}-{i}", name, reward)
            s.commit()

    spans: list[tuple[int, float, float, str]] = []

    def publish(version: int, path: Path, kind: str, *, weights: object = None) -> None:
        began = time.monotonic()
        assert (path / "adapter_config.json").is_file(), "the checkpoint is on disk before its publish"
        time.sleep(PUBLISH_S)
        spans.append((version, began, time.monotonic(), threading.current_thread().name))

    cfg = TrainConfig(lora=True, lora_rank=4, publish="lora", lr=1e-3, batch_sessions=4, min_sessions=4,
                      max_staleness=2, group_settle_s=0, checkpoint_dir=tmp_path / "ckpt", publish_overlap=True)
    trainer = Trainer(cfg, db, tiny_model_path, publish=publish)
    add_group("g1")
    add_group("g2")
    add_group("g3")
    returned = []
    for _ in range(3):
        assert trainer.step_once()
        returned.append(time.monotonic())
    trainer.close()  # waits for the last publish

    assert [v for v, *_ in spans] == [1, 2, 3], "published in order, each once"
    assert all(name.startswith("tracetrain-publish") for *_, name in spans)
    (_, b1, e1, _), (_, b2, e2, _), (_, b3, e3, _) = spans
    assert returned[0] < e1, "the first step returned while its version was still being published"
    assert e1 <= b2 and e2 <= b3, "a publish starts once the previous one is done"
    assert returned[2] < e3
    with Session(db) as s:
        rows = {p.version: p for p in queries.list_policies(s) if p.version}
    assert sorted(rows) == [1, 2, 3]
    assert all(p.published_at is not None and p.publish_error is None for p in rows.values())
    assert all(p.metrics["time_s"]["publish"] >= PUBLISH_S for p in rows.values())
