"""The OpenAI Agents SDK, unchanged, against the gateway: its default Responses model and its Chat
Completions model each run a function-tool loop that the store keeps as one exact trajectory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
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

from tests.support.recording import RecordingEngine, is_produced, trained_token_count
from tests.support.servers import RunningGateway
from tests.support.tool_model import ADD_TOOL, ANSWER, QUESTION
from tracetrain.proxy.redact import filler_id

set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI
REPO = Path(__file__).resolve().parents[2]


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


@pytest.mark.vllm
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_agents_example_records_each_episode_as_one_trajectory(vllm_gateway: RunningGateway, tmp_path: Path,
                                                               api: str) -> None:
    """The example runs as a user would run it, on vLLM: a forced tool call, its result, an answer."""
    out = tmp_path / "episodes.jsonl"
    subprocess.run([sys.executable, str(REPO / "examples/agents/openai_agents/agent.py"), "--gateway",
                    vllm_gateway.url, "--model", vllm_gateway.gateway.config.engine.served_model_name, "--api", api,
                    "--episodes", "2", "--group-size", "2", "--out", str(out)], check=True, timeout=600)
    episodes = [json.loads(line) for line in out.read_text().splitlines()]
    engine = vllm_gateway.gateway.engine
    assert isinstance(engine, RecordingEngine) and len(episodes) == 2
    filler = filler_id(vllm_gateway.gateway.renderer)
    for episode in episodes:
        url = f"{vllm_gateway.url}/v1/sessions/{episode['session_id']}"
        info = httpx.get(url, timeout=30).json()
        prefix = "resp_" if api == "responses" else "chatcmpl-"
        assert all(c["completion_id"].startswith(prefix) for c in info["calls"])
        assert info["status"] == "final" and [r["value"] for r in info["rewards"]] == [episode["reward"]]
        # A forced call cut off by max_tokens cannot be parsed: the SDK then has text, runs no tool.
        called = info["calls"][0]["finish_reason"] == "tool_calls"
        if episode["tool_runs"] is not None:  # None: the SDK refused a reply cut at max_tokens (reward 0)
            assert (episode["tool_runs"] >= 1) == called
        (trajectory,) = httpx.get(f"{url}/trajectory", timeout=30).json()["trajectories"]
        if called:
            (segment,) = trajectory["segments"]  # every later call extended the chain
            assert sum(segment["loss_mask"]) == trained_token_count(info["calls"])
        for segment in trajectory["segments"]:
            assert is_produced(segment["token_ids"], engine.generations, filler)
