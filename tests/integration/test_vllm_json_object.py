"""`response_format: json_object` through the gateway on a real vLLM (CPU, SmolLM2-135M): a short prompt ends in
valid JSON, as vLLM's own answer to the same request does.

SmolLM2 pretty-prints the JSON it is held to, four spaces per level. The engine bounds every whitespace run of a
JSON constraint (engines/vllm.py `json_constraint`, `json_max_whitespace`). A bound of 12, the old default,
forbade a newline plus the indentation of the third level (13 characters): the model, denied its own layout,
opened a string and looped inside it until max_tokens, where vLLM, free to indent, closed the object. The
default is now 64.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import OpenAI

from tests.integration.conftest import RunningVLLM
from tests.support.servers import RunningGateway
from tracetrain.engines.vllm_server import http_client

pytestmark = pytest.mark.vllm

SHORT: Any = [{"role": "user", "content": "Give me a JSON object."}]


@pytest.mark.parametrize("seed", [0, 1])
def test_json_object_on_a_short_prompt_is_valid_json_as_vllms_own(vllm_gateway: RunningGateway,
                                                                   vllm_server: RunningVLLM, seed: int) -> None:
    model = vllm_gateway.gateway.config.engine.served_model_name
    client = OpenAI(base_url=vllm_gateway.v1(f"json-object-{seed}"), api_key="unused", timeout=300, max_retries=0)
    reply = client.chat.completions.create(model=model, messages=SHORT, max_tokens=200, seed=seed,
                                           response_format={"type": "json_object"})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content or ""), dict)
    with http_client(vllm_server.url, timeout=300) as direct:
        own = direct.post("/v1/chat/completions", json={
            "model": vllm_server.model_name, "messages": SHORT, "max_tokens": 200, "seed": seed,
            "response_format": {"type": "json_object"}}).json()["choices"][0]
    assert own["finish_reason"] == "stop"
    assert choice.message.content == own["message"]["content"], "the same grammar samples the same JSON"
