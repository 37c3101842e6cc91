"""AgentScope's own `ReActAgent` and `OpenAIChatModel` through the real gateway and vLLM, token for token.

Approach: SmolLM2-135M rarely calls a tool by itself, so the test does not hope it will. `ReActAgent`
sends no `tool_choice` of its own (it would send "required" only while a structured output is pending,
and has no finishing function to call otherwise: a reasoning step without tool calls ends the reply).
`force_tool_choice(agent, "search", "none")` sets it through AgentScope's `pre_reasoning` hook: step one
names the search tool, which the gateway enforces by constrained decoding through vLLM (the `<tool_call>`
opener is forced, the JSON is held to the tool's schema); the tool runs for real in AgentScope's
`Toolkit`; step two is `tool_choice: "none"`, so whatever the model writes is the answer and the reply is
exactly two calls. Greedy decoding keeps the run reproducible. The example agent is also run as its own
command, sampling freely after the forced first step, with assertions that hold for any sample.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from agentscope.agent import ReActAgent
from agentscope.formatter import OpenAIChatFormatter
from agentscope.message import Msg, TextBlock
from agentscope.tool import Toolkit, ToolResponse

from tests.support.recording import RecordingEngine, assert_one_exact_segment
from tests.support.servers import RunningGateway
from tracetrain.adapters.agentscope import AgentScopeSession, force_tool_choice

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
FACTS = ["Dune is a novel written by Frank Herbert.", "Canberra is the capital of Australia."]


def search(query: str) -> ToolResponse:
    """Search the encyclopedia for passages about a topic.

    Args:
        query (str): Keywords describing what to look up.
    """
    words = {w.strip("?.,").lower() for w in query.split()}
    hits = [f for f in FACTS if words & {w.strip("?.,").lower() for w in f.split()}]
    return ToolResponse(content=[TextBlock(type="text", text="\n".join(hits) or "No passage found.")])


def _engine(gw: RunningGateway) -> RecordingEngine:
    engine = gw.gateway.engine
    assert isinstance(engine, RecordingEngine)
    return engine


async def test_react_agent_with_a_search_tool_is_one_exact_trajectory(vllm_gateway: RunningGateway) -> None:
    model_name = vllm_gateway.gateway.config.served_model_name
    async with AgentScopeSession(vllm_gateway.url, session_id="as-search", group_id="dune") as s:
        toolkit = Toolkit()
        toolkit.register_tool_function(search)
        model = s.chat_model(model_name, generate_kwargs={"temperature": 0, "max_tokens": 64})
        agent = ReActAgent(name="assistant", sys_prompt="Answer questions. Use the search tool to find facts.",
                           model=model, formatter=OpenAIChatFormatter(), toolkit=toolkit, max_iters=3)
        agent.set_console_output_enabled(False)
        force_tool_choice(agent, "search", "none")
        reply = await agent(Msg("user", "Who wrote Dune?", "user"))

        question, call_msg, result_msg, answer_msg = await agent.memory.get_memory()
        assert answer_msg.id == reply.id and question.get_text_content() == "Who wrote Dune?"
        (tool_use,) = call_msg.get_content_blocks("tool_use")
        (tool_result,) = result_msg.get_content_blocks("tool_result")
        assert tool_use["name"] == "search" and set(tool_use["input"]) == {"query"}
        assert tool_result["id"] == tool_use["id"]
        result_text = search(str(tool_use["input"]["query"])).content[0]["text"]  # type: ignore[typeddict-item]
        assert tool_result["output"] == [{"type": "text", "text": result_text}]
        assert not reply.get_content_blocks("tool_use")

        info = s.info()
        assert info["group_id"] == "dune"
        assert [c["completion_id"] for c in info["calls"]] == [call_msg.invocation_id, reply.invocation_id]
        assert [c["link"] for c in info["calls"]] == ["start", "extend"]
        assert [c["finish_reason"] for c in info["calls"]] == ["tool_calls", "stop"]
        generations = _engine(vllm_gateway).generations[-2:]
        (trajectory,) = s.trajectory()["trajectories"]
        segment = assert_one_exact_segment(trajectory, generations)

        tokenizer = vllm_gateway.gateway.renderer.tokenizer
        text = tokenizer.decode(segment["token_ids"])
        assert "<|im_start|>assistant\n<tool_call>\n" in text  # the call, after the system prompt's instructions
        assert f"<tool_response>\n{result_text}\n</tool_response>" in text
        # The forced opener is prompt (mask 0); the sampled ids are exactly the call AgentScope parsed and ran.
        assert tokenizer.decode(generations[0].prompt_ids).endswith("<|im_start|>assistant\n<tool_call>\n")
        sampled_call = json.loads(tokenizer.decode(generations[0].token_ids, skip_special_tokens=True))
        assert sampled_call == {"name": "search", "arguments": tool_use["input"]}
        assert reply.get_text_content() == tokenizer.decode(generations[1].token_ids, skip_special_tokens=True)

        await s.areward(0.5, completion_id=call_msg.invocation_id, final=False)
        await s.areward(1.0 if "Herbert" in (reply.get_text_content() or "") else 0.0)
        info = s.info()
        assert [r["call_id"] for r in info["rewards"]] == [info["calls"][0]["id"], None]
        assert info["status"] == "final"
    assert s._ahttp is None and s._http is None  # the model's connections were the session's, now closed


def test_react_search_example_records_each_episode(vllm_gateway: RunningGateway, tmp_path: Path) -> None:
    """The example runs as a user would run it (sampling at temperature 1 after the forced search)."""
    out = tmp_path / "episodes.jsonl"
    subprocess.run([sys.executable, str(REPO / "examples/agents/react_search/agent.py"), "--gateway",
                    vllm_gateway.url, "--model", vllm_gateway.gateway.config.served_model_name, "--episodes", "2",
                    "--group-size", "2", "--max-iters", "2", "--out", str(out)], check=True, timeout=600)
    episodes = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(episodes) == 2
    produced = {tuple(g.prompt_ids + g.token_ids) for g in _engine(vllm_gateway).generations}
    for episode in episodes:
        url = f"{vllm_gateway.url}/v1/sessions/{episode['session_id']}"
        info = httpx.get(url, timeout=30).json()
        calls = info["calls"]
        # Step one is the forced search, then an answer, or one more search and ReActAgent's summary. A forced
        # call the gateway could not parse (cut by max_tokens; "</tool_call>" inside the query string) is
        # text to the agent, which then answers with it at once.
        first = calls[0]["finish_reason"]
        assert (first == "tool_calls" and 2 <= len(calls) <= 3) or (first != "tool_calls" and len(calls) == 1)
        assert calls[-1]["completion_id"] == episode["last_completion_id"]
        assert info["status"] == "final" and [r["value"] for r in info["rewards"]] == [episode["reward"]]
        contains_fact = re.search(rf"\b{re.escape(episode['fact'].lower())}\b", episode["answer"].lower())
        assert episode["reward"] == (1.0 if contains_fact else 0.0)
        (trajectory,) = httpx.get(f"{url}/trajectory", timeout=30).json()["trajectories"]
        for segment in trajectory["segments"]:
            assert tuple(segment["token_ids"]) in produced
            assert sum(segment["loss_mask"]) == sum(
                c["completion_tokens"] for c in calls if f"{c['completion_id']}-0" in segment["call_ids"])
