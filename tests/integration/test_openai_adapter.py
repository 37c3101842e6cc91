"""The OpenAI SDK through `tracetrain.adapters.openai`, and the text-game example run as its own command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session

from tests.support.recording import RecordingEngine, is_produced, trained_token_count
from tests.support.servers import RunningGateway
from tracetrain.adapters.openai import OpenAISession
from tracetrain.proxy.redact import filler_id
from tracetrain.trainer.data import load_samples

REPO = Path(__file__).resolve().parents[2]
HELLO: Any = [{"role": "user", "content": "hi"}]


def test_session_binds_calls_and_posts_rewards(gateway: RunningGateway) -> None:
    with OpenAISession(gateway.url, group_id="g-1") as session:
        first = session.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3)
        follow_up: Any = [*HELLO, first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "user", "content": "more"}]
        session.client.chat.completions.create(model="tiny", messages=follow_up, max_tokens=3)
        session.reward(0.25, completion_id=first.id, final=False)
        session.reward({"accuracy": 1.0}, idempotency_key="end")
        again = session.reward({"accuracy": 1.0}, idempotency_key="end")
        info = session.info()
    assert again["duplicate"] is True
    assert info["id"] == session.session_id and info["group_id"] == "g-1" and info["status"] == "final"
    assert len(info["calls"]) == 2
    assert [(r["call_id"] is not None, r["final"]) for r in info["rewards"]] == [(True, False), (False, True)]
    assert session._client is None and session._http is None  # closed on exit


async def test_async_client_and_rejected_reward(gateway: RunningGateway) -> None:
    async with OpenAISession(gateway.url) as session:
        reply = await session.async_client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)
        assert reply.session_id == session.session_id  # type: ignore[attr-defined]
        await session.areward(1.0)
        with pytest.raises(httpx.HTTPStatusError) as raised:
            await session.areward(1.0, completion_id="chatcmpl-unknown")
    assert raised.value.response.status_code == 404
    assert raised.value.response.json()["error"]["code"]


@pytest.mark.vllm
def test_text_game_records_whole_games_and_discounts_the_late_reward(vllm_gateway: RunningGateway,
                                                                      tmp_path: Path) -> None:
    """The example runs as a user would run it; each game must be one trajectory whose tokens are the
    engine's, with the end-of-game reward on the last call, discounted back over the turns."""
    out = tmp_path / "games.jsonl"
    subprocess.run([sys.executable, str(REPO / "examples/agents/text_game/agent.py"), "--gateway", vllm_gateway.url,
                    "--model", vllm_gateway.gateway.config.engine.served_model_name, "--episodes", "4",
                    "--group-size", "2", "--max-turns", "4", "--reward-delay", "0.5", "--out", str(out)],
                   check=True, timeout=600)
    games = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(games) == 4
    engine = vllm_gateway.gateway.engine
    assert isinstance(engine, RecordingEngine)
    filler = filler_id(vllm_gateway.gateway.renderer)
    gamma = 0.9
    for game in games:
        info = httpx.get(f"{vllm_gateway.url}/v1/sessions/{game['session_id']}", timeout=30).json()
        assert len(info["calls"]) == game["turns"] and info["status"] == "final"
        (reward,) = info["rewards"]
        assert reward["call_id"] == f"{game['last_completion_id']}-0" and reward["value"] == game["reward"]
        trajectory = httpx.get(f"{vllm_gateway.url}/v1/sessions/{game['session_id']}/trajectory", timeout=30).json()
        (segment,) = trajectory["trajectories"][0]["segments"]
        assert segment["reason"] == "start" and len(segment["call_ids"]) == game["turns"]
        assert is_produced(segment["token_ids"], engine.generations, filler)  # the last prompt + sample
        assert sum(segment["loss_mask"]) == trained_token_count(info["calls"])
        with Session(vllm_gateway.gateway.db) as db:
            (sample,) = load_samples(db, [game["session_id"]], gamma=gamma)
        assert sample.reward == pytest.approx(gamma ** (game["turns"] - 1) * game["reward"])
