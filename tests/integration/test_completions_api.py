"""Text completions through the real OpenAI SDK: token-exact prompts (text or ids), a growing transcript
as one trajectory, streaming equal to a plain call, rewards by completion id, bad input as 400."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway

MODEL = "tiny"
PROMPT = "Once upon a time"


def _client(gw: RunningGateway, session: str | None = None) -> OpenAI:
    return OpenAI(base_url=gw.v1(session), api_key="unused", max_retries=0)


def _calls(gw: RunningGateway, session: str) -> list[dict[str, Any]]:
    return httpx.get(f"{gw.url}/v1/sessions/{session}").json()["calls"]  # type: ignore[no-any-return]


def test_text_and_token_prompts_reach_the_engine_exactly(gateway: RunningGateway) -> None:
    client = _client(gateway, "cmpl-exact")
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"return_token_ids": True})
    prompt_ids = first.model_extra["prompt_token_ids"]  # type: ignore[index]
    assert prompt_ids == gateway.gateway.renderer.encode(PROMPT)
    engine = gateway.gateway.engine
    assert isinstance(engine, RecordingEngine)
    sampled = first.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert (engine.generations[-1].prompt_ids, engine.generations[-1].token_ids) == (prompt_ids, sampled)
    # the same prompt as ids gives the same greedy text
    again = _client(gateway).completions.create(model=MODEL, prompt=prompt_ids, max_tokens=6, temperature=0)
    assert again.choices[0].text == first.choices[0].text


def test_a_growing_transcript_is_one_trajectory(gateway: RunningGateway) -> None:
    client = _client(gateway, "cmpl-chain")
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1, seed=1,
                                      extra_body={"return_token_ids": True})
    chain = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]  # type: ignore[index]
    more = gateway.gateway.renderer.encode(" and then")
    client.completions.create(model=MODEL, prompt=chain + more, max_tokens=4, temperature=1, seed=2)
    client.completions.create(model=MODEL, prompt="Something else entirely", max_tokens=4)
    calls = _calls(gateway, "cmpl-chain")
    assert [c["link"] for c in calls] == ["start", "extend", "prefix_changed"]
    assert calls[1]["prefix_len"] == len(chain) and calls[1]["prompt_tokens"] == len(chain) + len(more)
    posted = httpx.post(f"{gateway.url}/v1/rewards", json={"completion_id": first.id, "reward": 1.0})
    assert posted.status_code == 200 and posted.json()["session_id"] == "cmpl-chain"


def test_streaming_yields_the_plain_calls_text(gateway: RunningGateway) -> None:
    client = _client(gateway, "cmpl-stream")
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    pieces = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text
    assert pieces[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert len(_calls(gateway, "cmpl-stream")) == 2


@pytest.mark.parametrize(("change", "param"), [
    ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"), ({"prompt": ""}, "prompt"), ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_input_is_400_and_records_nothing(gateway: RunningGateway, change: dict[str, Any], param: str) -> None:
    response = httpx.post(f"{gateway.url}/s/cmpl-bad/v1/completions",
                          json={"model": MODEL, "prompt": PROMPT, **change})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert httpx.get(f"{gateway.url}/v1/sessions/cmpl-bad").status_code == 404
