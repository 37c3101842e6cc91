"""The OpenAPI document describes what the gateway does: every path parameter declared, 400 (not 422)
with the error body each API really sends; and an absurd offset is a 400, not a 500."""

from __future__ import annotations

import re
from typing import Any

import httpx
import jsonschema_rs
import pytest

from tests.support.servers import RunningGateway


def test_the_document_declares_path_parameters_and_real_error_statuses(gateway: RunningGateway) -> None:
    document = httpx.get(f"{gateway.url}/openapi.json").json()
    assert "/s/{session}/g/{group}/v1/responses" in document["paths"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            declared = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
            assert set(re.findall(r"{(\w+)}", path)) <= declared, (method, path)
            assert "422" not in operation["responses"], (method, path)
            if operation.get("requestBody"):
                error = "AnthropicError" if path.endswith(("/v1/messages", "/v1/messages/count_tokens")) else "Error"
                schema = operation["responses"]["400"]["content"]["application/json"]["schema"]
                assert schema["$ref"] == f"#/components/schemas/{error}", (method, path)


def test_an_absurd_offset_is_a_400(gateway: RunningGateway) -> None:
    response = httpx.get(f"{gateway.url}/v1/sessions", params={"offset": 233270564766621859840})
    assert response.status_code == 400 and response.json()["error"]["param"] == "offset"
    assert httpx.get(f"{gateway.url}/v1/sessions", params={"offset": 2**62}).status_code == 200


def test_the_console_api_is_documented(gateway: RunningGateway) -> None:
    document = httpx.get(f"{gateway.url}/openapi.json").json()
    paths, schemas = document["paths"], document["components"]["schemas"]

    def ok_schema(path: str, method: str) -> str:
        operation = paths[path][method]
        assert operation["responses"]["403"]["content"]["application/json"]["schema"]["$ref"] == \
            "#/components/schemas/Error", (method, path)
        return str(operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]).rsplit("/", 1)[-1]

    for action in ("exclude", "include", "reward_override"):
        path = f"/v1/sessions/{{session_id}}/{action}"
        assert ok_schema(path, "post") == "CorrectionResponse"
        assert paths[path]["post"]["responses"]["404"]["description"] == "No such session"
    assert ok_schema("/v1/sessions/{session_id}/actions", "get") == "ActionList"
    assert ok_schema("/v1/stats/capture", "get") == "CaptureStats"
    override = paths["/v1/sessions/{session_id}/reward_override"]["post"]["requestBody"]["content"]
    body = schemas[override["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]]
    assert set(body["required"]) == {"reward", "note"} and body["properties"]["reward"]["type"] == "number"
    listing = paths["/v1/sessions"]["get"]
    assert listing["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/SessionList")
    params = {p["name"] for p in listing["parameters"]}
    assert {"limit", "offset", "status", "reward_min", "reward_max", "group", "model", "q", "excluded", "trained",
            "sort", "order"} <= params
    summary = schemas["SessionSummary"]["properties"]
    assert {"id", "group_id", "status", "created_at", "updated_at", "reward", "calls", "tokens", "excluded",
            "policy_version_min", "policy_version_max"} <= summary.keys()


CHAT: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MESSAGES: dict[str, Any] = {**CHAT}
COMPLETION: dict[str, Any] = {"model": "tiny", "prompt": "Once", "max_tokens": 2}
RESPONSE: dict[str, Any] = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
AGREEMENT: list[tuple[str, dict[str, Any]]] = [
    # What the fuzzer found the document allowed and the gateway refused, or the reverse.
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "retrieval"}]}),
    ("/v1/chat/completions", {**CHAT, "tools": [{"function": {"parameters": {"type": "object"}, "name": "add"},
                                                 "type": "function"}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "5"}]}),
    ("/v1/chat/completions", {**CHAT, "stream": 0}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "2"}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2.0}),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": 0.5}),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": 0, "logit_bias": {}, "parallel_tool_calls": False}),
    ("/v1/chat/completions", {**CHAT, "top_k": False}),
    ("/v1/chat/completions", {**CHAT, "user": "a\u200bb"}),
    ("/v1/chat/completions", {**CHAT, "user": "", "metadata": {"session_id": "", "note": "x"}}),
    ("/v1/chat/completions", {**CHAT, "metadata": {"session_id": "a\nb"}}),
    ("/v1/messages", {**MESSAGES, "top_k": 5}),
    ("/v1/messages", {**MESSAGES, "top_k": 0}),
    ("/v1/messages", {**MESSAGES, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
    ("/v1/messages", {**MESSAGES, "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "x"}]}]}),
    ("/v1/messages", {**MESSAGES, "tool_choice": {"type": "tool"}}),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {**COMPLETION, "prompt": ""}),
    ("/v1/completions", {**COMPLETION, "prompt": ["a", "b"]}),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 2, 3]}),
    ("/v1/completions", {**COMPLETION, "echo": True}),
    ("/v1/completions", {**COMPLETION, "echo": 0}),
    ("/v1/responses", {**RESPONSE, "input": [{"type": "reasoning"}]}),
    ("/v1/responses", {**RESPONSE, "input": [{}]}),
    ("/v1/responses", {**RESPONSE, "tools": [{"type": "web_search"}]}),
    ("/v1/responses", {**RESPONSE, "text": {"format": {"type": "json_schema"}}}),
    ("/v1/rewards", {"reward": 1.0}),
    ("/v1/rewards", {"reward": 1.0, "session_id": ""}),
    ("/v1/rewards", {"reward": {}, "session_id": "nobody"}),
    ("/v1/rewards", {"reward": 1.0, "session_id": "nobody"}),
    ("/v1/rewards", {"reward": 1.0, "completion_id": None}),
    ("/v1/policies", {"version": 1, "checkpoint": "", "kind": "full"}),
    ("/v1/policies", {"version": 1, "checkpoint": "/nowhere", "kind": "full"}),
]


def _body_schema(document: dict[str, Any], path: str) -> jsonschema_rs.Validator:
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema_rs.validator_for({**schema, "components": document["components"]})


@pytest.mark.parametrize(("path", "body"), AGREEMENT, ids=[f"{p}-{i}" for i, (p, _) in enumerate(AGREEMENT)])
def test_the_document_allows_exactly_what_the_gateway_takes(gateway: RunningGateway, path: str,
                                                            body: dict[str, Any]) -> None:
    """The request models are the one statement of both: a body the document allows is never a 400 (it may be
    a 404: no such session), and one it forbids always is."""
    document = httpx.get(f"{gateway.url}/openapi.json").json()
    allowed = _body_schema(document, path).is_valid(body)
    response = httpx.post(gateway.url + path, json=body, timeout=60)
    assert (response.status_code != 400) == allowed, (allowed, response.status_code, response.text)


def test_the_document_uses_json_schema_keywords_only(gateway: RunningGateway) -> None:
    """pydantic writes the bounds of a validated type inside a union as `ge`/`le`, which JSON Schema ignores: a
    bound the document does not state is one the fuzzer and every client generator break."""
    text = httpx.get(f"{gateway.url}/openapi.json").text
    assert not re.findall(r'"(?:ge|le|gt|lt)":', text)
