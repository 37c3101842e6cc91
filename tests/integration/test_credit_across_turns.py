"""Credit for a multi-turn tool episode rewarded once, at its end (issue: learning from real traffic).

A LangChain tool agent, unchanged, runs through the real gateway in front of the in-process tool model: its
first turn calls `add`, the tool runs, its second turn answers. A new version is published between the two
turns, as happens while agents keep running. One final reward follows the episode. What the trainer then
trains on must be the whole episode: one sample whose loss mask is 1 on exactly the tokens the model sampled
in each turn (the tool's answer and the prompts are 0), each sampled token labelled with the version that
sampled it, and the step must train every one of those tokens with the episode's reward.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from sqlmodel import Session

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, start_gateway
from tests.support.tool_model import ADD_TOOL, ANSWER, QUESTION
from tracetrain.adapters.langchain import LangChainSession
from tracetrain.config import TrainConfig
from tracetrain.engines.transformers_publish import InProcessPublisher
from tracetrain.store import queries
from tracetrain.store.db import open_db
from tracetrain.store.models import AgentSession
from tracetrain.trainer.data import load_samples
from tracetrain.trainer.loop import Trainer

pytestmark = pytest.mark.slow


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
def gateway(tool_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    from tracetrain.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(tool_model_path, model_name="tool-tiny")  # its own: the test publishes into it
    running = start_gateway(RecordingEngine(engine), tool_model_path, f"sqlite:///{tmp_path / 'store.db'}",
                            publisher=InProcessPublisher(engine))
    yield running
    running.stop()


def test_every_turn_of_an_episode_rewarded_at_its_end_is_trained_with_its_own_version(
        gateway: RunningGateway, tool_model_path: Path, tmp_path: Path) -> None:
    # Version 1 is a copy of the served weights, so the agent's second turn goes on as the first would have.
    v1 = tmp_path / "v1"
    shutil.copytree(tool_model_path, v1)

    async def episode() -> list[BaseMessage]:
        async with LangChainSession(gateway.url, session_id="episode") as s:
            llm = s.chat_model("tool-tiny", temperature=0).bind_tools([ADD_TOOL])
            messages: list[BaseMessage] = [HumanMessage(QUESTION)]
            for turn in range(3):
                if turn == 1:  # published while the agent runs its tool
                    async with httpx.AsyncClient(timeout=120) as client:
                        published = await client.post(f"{gateway.url}/v1/policies", json={
                            "version": 1, "checkpoint": str(v1), "kind": "full"})
                    assert published.status_code == 200, published.text
                reply = await llm.ainvoke(messages)
                messages.append(reply)
                if not isinstance(reply, AIMessage) or not reply.tool_calls:
                    break
                for call in reply.tool_calls:
                    result = add.invoke(call)
                    assert isinstance(result, ToolMessage)
                    messages.append(result)
            await s.areward(1.0 if messages[-1].text == ANSWER else 0.0)  # once, at the end
        return messages

    messages = asyncio.run(episode())
    assert [type(m).__name__ for m in messages] == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    engine = gateway.gateway.engine
    assert isinstance(engine, RecordingEngine)
    first, second = engine.generations[-2:]

    db = open_db(gateway.gateway.config.store.url)
    with Session(db) as s:
        (sample,) = load_samples(s, ["episode"])
    assert sample.reward == 1.0
    assert sample.input_ids == second.prompt_ids + second.token_ids
    # The loss mask is 1 on exactly what the model sampled in each turn; the tool's answer between them is 0.
    spans = [(len(g.prompt_ids), len(g.prompt_ids) + len(g.token_ids)) for g in (first, second)]
    expected_mask = [0] * len(sample.input_ids)
    for start, end in spans:
        expected_mask[start:end] = [1] * (end - start)
    assert sample.loss_mask == expected_mask
    assert sample.logprobs[spans[0][0]:spans[0][1]] == pytest.approx(first.logprobs)
    assert sample.logprobs[spans[1][0]:spans[1][1]] == pytest.approx(second.logprobs)
    # Each sampled token carries the version that sampled it: the first turn version 0, the second version 1.
    assert set(sample.versions[spans[0][0]:spans[0][1]]) == {0}
    assert set(sample.versions[spans[1][0]:spans[1][1]]) == {1}
    assert sample.oldest_version == 0

    # The trainer trains every sampled token of both turns, with the episode's one reward.
    cfg = TrainConfig(lora=True, lora_rank=4, publish="lora", lr=1e-3, batch_sessions=1, min_sessions=1,
                      max_staleness=4, group_settle_s=0, checkpoint_dir=tmp_path / "ckpt")
    trainer = Trainer(cfg, db, tool_model_path)
    try:
        assert trainer.step_once()
    finally:
        trainer.close()
    with Session(db) as s:
        session = s.get(AgentSession, "episode")
        version = trainer.version
        rows = {p.version: p for p in queries.list_policies(s)}
    assert session is not None and session.trained_version == version
    figures = rows[version].metrics
    assert figures["trained_tokens"] == sum(end - start for start, end in spans)
    assert figures["reward_mean"] == 1.0 and figures["samples"] == 1
