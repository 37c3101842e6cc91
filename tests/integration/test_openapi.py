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
