"""The OpenAPI document describes what the gateway does: every path parameter declared, 400 (not 422)
with the error body each API really sends; and an absurd offset is a 400, not a 500."""

from __future__ import annotations

import re

import httpx

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
                error = "AnthropicError" if path.endswith("/v1/messages") else "Error"
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
