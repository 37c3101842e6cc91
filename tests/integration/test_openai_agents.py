"""The OpenAI Agents SDK, unchanged, against the gateway: its default Responses model and its Chat
Completions model each run a function-tool loop that the store keeps as one exact trajectory."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway
from tests.support.tool_model import ADD_TOOL, ANSWER, QUESTION

set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI


def _add_tool(seen: list[dict[str, Any]]) -> FunctionTool:
    async def invoke(_context: Any, arguments: str) -> str:
        values = json.loads(arguments)
        seen.append(values)
        return str(values["a"] + values["b"])

    function = ADD_TOOL["function"]
    return FunctionTool(name=function["name"], description=function["description"],
                        params_json_schema=function["parameters"], on_invoke_tool=invoke, strict_json_schema=False)


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_a_function_tool_run_is_one_exact_trajectory(tool_gateway: RunningGateway, api: str) -> None:
    session = f"agents-{api}"
    client = AsyncOpenAI(base_url=tool_gateway.v1(session), api_key="unused", max_retries=0)
    model = (OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel)(
        model="tool-tiny", openai_client=client)
    seen: list[dict[str, Any]] = []
    agent = Agent(name="adder", model=model, tools=[_add_tool(seen)],
                  model_settings=ModelSettings(temperature=0, max_tokens=48))
    result = await Runner.run(agent, QUESTION, max_turns=3)
    assert seen == [{"a": 2, "b": 3}] and result.final_output == ANSWER

    calls = httpx.get(f"{tool_gateway.url}/v1/sessions/{session}").json()["calls"]
    assert [c["link"] for c in calls] == ["start", "extend"], "the tool result extends the token chain"
    engine = tool_gateway.gateway.engine
    assert isinstance(engine, RecordingEngine)
    first, second = engine.generations[-2:]
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.token_ids)] == first.prompt_ids + first.token_ids
