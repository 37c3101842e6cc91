"""A canary decided in this process while `Promotion.follow()` reads the store must stay decided.

The interleaving is forced, not hoped for: follow's read of the store returns its snapshot only after the
decision has been made (or after a second, should the decision be unable to start meanwhile). A follow that
read the store outside the promotion lock saw the rolled-back version still marked as the canary and staged
it again; reading under the lock makes the decision wait for the read, so the snapshot is never stale.

Real parts: the in-process engine with the tiny tool model, its publisher, a SQLite store and its writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlmodel import Session

from tracetrain.config import PromotionConfig
from tracetrain.engines.publishing import Checkpoint
from tracetrain.engines.transformers_engine import TransformersEngine
from tracetrain.engines.transformers_publish import InProcessPublisher
from tracetrain.proxy.gateway import read_in_thread
from tracetrain.proxy.promotion import Promotion
from tracetrain.store import promotion as store
from tracetrain.store.db import open_db
from tracetrain.store.writer import StoreWriter


async def test_a_canary_rolled_back_during_a_follow_is_not_staged_again(tool_model_path: Path,
                                                                       tmp_path: Path) -> None:
    db = open_db(f"sqlite:///{tmp_path / 'store.db'}")
    writer = StoreWriter(db)
    await writer.start()
    engine = TransformersEngine(tool_model_path, model_name="tool-tiny")
    snapshot_taken, decided = asyncio.Event(), asyncio.Event()

    async def read_then_wait_for_the_decision(fn: Callable[[Session], Any]) -> Any:
        snapshot = await read_in_thread(db, fn)
        snapshot_taken.set()
        with contextlib.suppress(TimeoutError):  # the decision waits for this read: go on without it
            await asyncio.wait_for(decided.wait(), timeout=1.0)
        return snapshot

    promotion = Promotion(PromotionConfig(mode="canary", canary_share=0.5), engine,
                          read=read_then_wait_for_the_decision, write=writer.submit,
                          publisher=InProcessPublisher(engine))
    try:
        checkpoint = shutil.copytree(tool_model_path, tmp_path / "v1")
        await promotion.stage(Checkpoint(1, checkpoint, "full"))
        assert promotion.trial is not None and engine.holds(1)

        async def roll_back() -> None:
            await snapshot_taken.wait()
            assert await promotion.decide(1, store.ROLLED_BACK, {"by": "admin"})
            decided.set()

        await asyncio.gather(promotion.follow(), roll_back())

        assert promotion.trial is None, "the rolled-back canary was staged again"
        assert not engine.holds(1)
        assert promotion.version_for(new=True, key="any session", pinned=None) is None
        assert await read_in_thread(db, store.canary) is None
        # A later round changes nothing.
        await promotion.follow()
        assert promotion.trial is None and not engine.holds(1)
    finally:
        await writer.stop()
        await engine.close()
