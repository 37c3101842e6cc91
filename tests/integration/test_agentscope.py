"""AgentScope 2's own `Agent`, `Toolkit` and `OpenAIChatModel` through the real gateway and vLLM, token for token.

Approach: SmolLM2-135M rarely calls a tool by itself, so the test does not hope it will. `Agent` sends no
`tool_choice` of its own (only for a pending structured output or its tool-less summary after
`max_iters`), and a reasoning step without tool calls ends the reply. `ForceToolChoice("search", "none")`,
an AgentScope middleware on the reasoning step, sets it: step one names the search tool, which the gateway
enforces by constrained decoding through vLLM (the `<tool_call>` opener is forced, the JSON is held to the
tool's schema, whose `maxLength` bounds the query); the tool runs for real in AgentScope's `Toolkit`; step
two is `tool_choice: "none"`, so whatever the model writes is the answer and the reply is exactly two
calls. The agent otherwise keeps AgentScope's defaults, including the runtime-state hint (the wall-clock
time) it appends before the first step, so what the model writes is not fixed from run to run: the
assertions hold for any sample. Both model modes run: streamed (AgentScope's default) and not. The
example agent is also run as its own command, sampling after the forced first step.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import httpx
import pytest
from agentscope.agent import Agent, ReActConfig
from agentscope.message import HintBlock, TextBlock, ToolCallBlock, ToolResultBlock, UserMsg
from agentscope.model import OpenAIChatModel
from agentscope.tool import FunctionTool, ToolChunk, Toolkit
from pydantic import Field

from tests.support.recording import RecordingEngine, assert_one_exact_segment, is_produced, trained_token_count
from tests.support.servers import RunningGateway
from tracetrain.adapters.agentscope import AgentScopeSession, ForceToolChoice
from tracetrain.proxy.redact import filler_id

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
FACTS = ["Dune is a novel written by Frank Herbert.", "Canberra is the capital of Australia."]


def _terms(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower())) - {"a", "is", "of", "the", "who", "by"}


def lookup(query: str) -> str:
    return "\n".join(f for f in FACTS if _terms(query) & _terms(f)) or "No passage found."


def _search_tool(queries: list[str]) -> FunctionTool:
    """A search function tool that records the queries it ran. Read-only, so AgentScope's permission engine
    lets it run without asking a user (a plain function tool would park the reply awaiting confirmation)."""

    def search(query: Annotated[str, Field(max_length=40)]) -> ToolChunk:
        """Search the encyclopedia for passages about a topic.

        Args:
            query (str): Keywords describing what to look up.
        """
        queries.append(query)
        return ToolChunk(content=[TextBlock(text=lookup(query))])

    return FunctionTool(search, is_read_only=True)


def _engine(gw: RunningGateway) -> RecordingEngine:
    engine = gw.gateway.engine
    assert isinstance(engine, RecordingEngine)
    return engine


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
async def test_agent_with_a_search_tool_is_one_exact_trajectory(vllm_gateway: RunningGateway, stream: bool) -> None:
    model_name = vllm_gateway.gateway.config.engine.served_model_name
    queries: list[str] = []
    async with AgentScopeSession(vllm_gateway.url, session_id=f"as-search-{stream}", group_id="dune") as s:
        model = s.chat_model(model_name, stream=stream,
                             parameters=OpenAIChatModel.Parameters(temperature=0, max_tokens=64))
        agent = Agent(name="assistant", system_prompt="Answer questions. Use the search tool to find facts.",
                      model=model, toolkit=Toolkit(tools=[_search_tool(queries)]),
                      middlewares=[s.middleware, ForceToolChoice("search", "none")],
                      react_config=ReActConfig(max_iters=3))
        reply = await agent.reply(UserMsg("user", "Who wrote Dune?"))

        # AgentScope keeps a reply as one message: its hint, the call, the tool's result, the answer.
        question, turn = agent.state.context
        assert question.get_text_content() == "Who wrote Dune?" and turn.id == reply.id
        hint, call, result, answer = turn.content
        assert isinstance(hint, HintBlock) and isinstance(hint.hint, str) and "<current-time>" in hint.hint
        assert isinstance(call, ToolCallBlock) and isinstance(result, ToolResultBlock)
        assert isinstance(answer, TextBlock)
        arguments = json.loads(call.input)
        assert call.name == "search" and queries == [arguments["query"]], "the tool ran, once, on the call's query"
        assert result.id == call.id and result.state == "success"
        assert isinstance(result.output, list) and [b.text for b in result.output if isinstance(b, TextBlock)] == [
            lookup(queries[0])]
        assert reply.content == [answer] and not reply.get_content_blocks("tool_call")

        info = s.info()
        assert info["group_id"] == "dune"
        assert [c["completion_id"] for c in info["calls"]] == s.completion_ids and len(s.completion_ids) == 2
        assert [c["link"] for c in info["calls"]] == ["start", "extend"]
        assert info["calls"][0]["finish_reason"] == "tool_calls"
        assert info["calls"][1]["finish_reason"] in ("stop", "length")
        generations = _engine(vllm_gateway).generations[-2:]
        (trajectory,) = s.trajectory()["trajectories"]
        segment = assert_one_exact_segment(trajectory, generations)

        tokenizer = vllm_gateway.gateway.renderer.tokenizer
        text = tokenizer.decode(segment["token_ids"])
        assert f"<|im_start|>user\n{hint.hint}<|im_end|>" in text  # the hint is a user turn of the prompt
        assert f"<tool_response>\n{lookup(queries[0])}\n</tool_response>" in text
        # The forced opener is prompt (mask 0); the sampled ids are exactly the call AgentScope parsed and ran.
        assert tokenizer.decode(generations[0].prompt_ids).endswith("<|im_start|>assistant\n<tool_call>\n")
        sampled_call = json.loads(tokenizer.decode(generations[0].token_ids, skip_special_tokens=True))
        assert sampled_call == {"name": "search", "arguments": arguments}
        assert answer.text == tokenizer.decode(generations[1].token_ids, skip_special_tokens=True)

        await s.areward(0.5, completion_id=s.completion_ids[0], final=False)
        await s.areward(1.0 if "Herbert" in answer.text else 0.0)
        info = s.info()
        assert [r["call_id"] for r in info["rewards"]] == [info["calls"][0]["id"], None]
        assert info["status"] == "final"
    assert s._ahttp is None and s._http is None  # the model's connections were the session's, now closed


def test_agentscope_search_example_records_each_episode(vllm_gateway: RunningGateway, tmp_path: Path) -> None:
    """The example runs as a user would run it (streamed, sampling at temperature 1 after the forced search)."""
    out = tmp_path / "episodes.jsonl"
    subprocess.run([sys.executable, str(REPO / "examples/agents/agentscope_search/agent.py"), "--gateway",
                    vllm_gateway.url, "--model", vllm_gateway.gateway.config.engine.served_model_name,
                    "--episodes", "2", "--group-size", "2", "--max-iters", "2", "--out", str(out)],
                   check=True, timeout=600)
    episodes = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(episodes) == 2
    filler = filler_id(vllm_gateway.gateway.renderer)
    for episode in episodes:
        url = f"{vllm_gateway.url}/v1/sessions/{episode['session_id']}"
        info = httpx.get(url, timeout=30).json()
        calls = info["calls"]
        # Step one is the forced search, then an answer, or one more search and the agent's tool-less summary.
        # A forced call the gateway could not parse (cut by max_tokens) is text to the agent: the answer.
        first = calls[0]["finish_reason"]
        assert (first == "tool_calls" and 2 <= len(calls) <= 3) or (first != "tool_calls" and len(calls) == 1)
        assert episode["completion_ids"] == [c["completion_id"] for c in calls]  # streamed calls too
        assert info["status"] == "final" and [r["value"] for r in info["rewards"]] == [episode["reward"]]
        contains_fact = re.search(rf"\b{re.escape(episode['fact'].lower())}\b", episode["answer"].lower())
        assert episode["reward"] == (1.0 if contains_fact else 0.0)
        # AgentScope only appends to a reply (the summary's instruction too), so an episode is one segment.
        (trajectory,) = httpx.get(f"{url}/trajectory", timeout=30).json()["trajectories"]
        (segment,) = trajectory["segments"]
        assert is_produced(segment["token_ids"], _engine(vllm_gateway).generations, filler)
        assert len(segment["call_ids"]) == len(calls)
        assert sum(segment["loss_mask"]) == trained_token_count(calls)
