"""Streams send text as it comes: nothing waits for the call's record, which only the last events do.

The engine here hands over all of a generation's deltas at once, its finish included, as vLLM does
under load (the gateway reads every event that arrived in one go): the stream must still send the text
before it waits for the record.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.servers import RunningGateway, start_gateway
from tracetrain.engines.base import Affinity, Engine, SamplingParams, TokenDelta
from tracetrain.engines.transformers_engine import TransformersEngine


class BurstEngine:
    """A real engine whose deltas arrive together: generated first, then handed over without a pause."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.model_name = inner.model_name

    @property
    def version(self) -> int:
        return self.inner.version

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       affinity: Affinity | None = None) -> AsyncIterator[TokenDelta]:
        deltas = [delta async for delta in self.inner.generate(prompt_ids, params, affinity)]
        for delta in deltas:
            yield delta

    async def close(self) -> None:
        pass  # the tiny engine is shared by the module's other tests


@pytest.fixture
def bursting(tiny_engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    running = start_gateway(BurstEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp_path / 'gw.db'}")
    yield running
    running.stop()

BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}),
    "completions": ("/completions", {"prompt": "hi", "max_tokens": 8}),
    "responses": ("/responses", {"input": "hi", "max_output_tokens": 8}),
    "messages": ("/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}),
}
TEXT_MARKS = ('"content":"', '"text":"', '"type":"response.output_text.delta"', '"type":"text_delta"')
EMPTY_MARKS = ('"content":""', '"text":""')


def _has_text(line: str) -> bool:
    compact = line.replace(" ", "")
    return any(m in compact for m in TEXT_MARKS) and not any(m in compact for m in EMPTY_MARKS)


@pytest.mark.parametrize("api", list(BODIES))
def test_streamed_text_does_not_wait_for_the_record(bursting: RunningGateway, api: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    gateway = bursting
    writer = gateway.gateway.writer
    submit = writer.submit

    async def slow_submit(op: Any) -> Any:
        await asyncio.sleep(1.5)  # a store that takes its time to commit
        return await submit(op)

    monkeypatch.setattr(writer, "submit", slow_submit)
    path, body = BODIES[api]
    body = {**body, "model": gateway.gateway.config.engine.served_model_name, "stream": True, "temperature": 0.0}
    first_text = last = None
    with httpx.Client(timeout=60) as client, \
            client.stream("POST", f"{gateway.v1(f'stream-{api}')}{path}", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            now = time.monotonic()
            if first_text is None and _has_text(line):
                first_text = now
            if line:
                last = now
    assert first_text is not None and last is not None
    assert last - first_text > 1.0, "the text waited for the record"
