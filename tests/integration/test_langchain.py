"""LangChain's own `ChatOpenAI` and tool loop through the real gateway, recorded token for token.

Approach: SmolLM2-135M rarely calls a tool by itself, so the vLLM test does not hope it will. Its first
turn is `bind_tools([calculator], tool_choice="calculator")`, which the gateway enforces by constrained
decoding through vLLM (the `<tool_call>` opener is forced, the JSON is held to the tool's schema); the
tool runs for real and the model then answers freely with the tools still bound. Greedy decoding keeps
the run reproducible. The second test uses the in-process tiny tool model (`tests/support/tool_model.py`),
trained to call `add` unprompted, so a tool call the model chose itself is covered without vLLM.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolCall, ToolMessage
from langchain_core.tools import BaseTool, tool

from tests.support.recording import Generation, RecordingEngine, assert_one_exact_segment
from tests.support.servers import RunningGateway
from tests.support.tool_model import ADD_TOOL, ANSWER, QUESTION
from tracetrain.adapters.langchain import LangChainSession


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as "17 * 23" and return the result."""
    match = re.fullmatch(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*", expression)
    if not match:
        return f"error: cannot evaluate {expression!r}"
    a, op, b = int(match[1]), match[2], int(match[3])
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _run(tool_: BaseTool, call: ToolCall) -> ToolMessage:
    message = tool_.invoke(call)
    assert isinstance(message, ToolMessage)
    return message


def _generations(gw: RunningGateway, turns: int) -> list[Generation]:
    engine = gw.gateway.engine
    assert isinstance(engine, RecordingEngine)
    return engine.generations[-turns:]


@pytest.mark.vllm
def test_langchain_tool_loop_through_vllm_is_one_exact_trajectory(vllm_gateway: RunningGateway) -> None:
    model = vllm_gateway.gateway.config.engine.served_model_name
    with LangChainSession(vllm_gateway.url, session_id="lc-calc", group_id="mul-17-23") as s:
        llm = s.chat_model(model, temperature=0, max_tokens=128)
        messages: list[BaseMessage] = [SystemMessage("Use the calculator for arithmetic."),
                                       HumanMessage("What is 17 * 23?")]
        forced = llm.bind_tools([calculator], tool_choice="calculator").invoke(messages)
        assert isinstance(forced, AIMessage)
        (call,) = forced.tool_calls
        assert call["name"] == "calculator" and set(call["args"]) == {"expression"}
        result = _run(calculator, call)
        messages += [forced, result]
        answer = llm.bind_tools([calculator]).invoke(messages)
        assert isinstance(answer, AIMessage)

        info = s.info()
        assert info["group_id"] == "mul-17-23"
        assert [c["completion_id"] for c in info["calls"]] == s.completion_ids and len(s.completion_ids) == 2
        assert [c["link"] for c in info["calls"]] == ["start", "extend"]
        generations = _generations(vllm_gateway, 2)
        (trajectory,) = s.trajectory()["trajectories"]
        segment = assert_one_exact_segment(trajectory, generations)

        tokenizer = vllm_gateway.gateway.renderer.tokenizer
        text = tokenizer.decode(segment["token_ids"])
        assert text.count("<tool_call>") >= 1 and f"<tool_response>\n{result.content}\n</tool_response>" in text
        # The forced opener is prompt (mask 0); the sampled ids are exactly the call LangChain parsed.
        assert tokenizer.decode(generations[0].prompt_ids).endswith("<|im_start|>assistant\n<tool_call>\n")
        sampled_call = json.loads(tokenizer.decode(generations[0].token_ids, skip_special_tokens=True))
        assert sampled_call == {"name": "calculator", "arguments": call["args"]}

        s.reward(0.5, completion_id=s.completion_ids[0], final=False)
        s.reward(1.0 if "391" in answer.text else 0.0)
        info = s.info()
        assert [r["call_id"] for r in info["rewards"]] == [info["calls"][0]["id"], None]
        assert info["status"] == "final"


def test_langchain_tool_call_chosen_by_the_model_is_recorded(tool_gateway: RunningGateway) -> None:
    """The async path (`ainvoke`, the session's async HTTP client) with a tool call the model chose."""

    async def agent(s: LangChainSession) -> list[BaseMessage]:
        # The dict is the schema the tiny model was trained on; `add` runs the call.
        llm = s.chat_model("tool-tiny", temperature=0).bind_tools([ADD_TOOL])
        messages: list[BaseMessage] = [HumanMessage(QUESTION)]
        for _ in range(3):
            reply = await llm.ainvoke(messages)
            messages.append(reply)
            if not isinstance(reply, AIMessage) or not reply.tool_calls:
                break
            messages += [_run(add, call) for call in reply.tool_calls]
        await s.areward(1.0 if messages[-1].text == ANSWER else 0.0)
        return messages

    async def episode() -> LangChainSession:
        async with LangChainSession(tool_gateway.url, session_id="lc-add") as s:
            messages = await agent(s)
        assert [type(m).__name__ for m in messages] == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
        assert messages[-1].text == ANSWER and messages[2].content == "5"
        return s

    with asyncio.run(episode()) as s:
        info = s.info()
        assert [c["completion_id"] for c in info["calls"]] == s.completion_ids and len(s.completion_ids) == 2
        assert info["status"] == "final" and info["reward_total"] == 1.0
        (trajectory,) = s.trajectory()["trajectories"]
        segment = assert_one_exact_segment(trajectory, _generations(tool_gateway, 2))
    text = tool_gateway.gateway.renderer.tokenizer.decode(segment["token_ids"])
    assert "<tool_call>" in text and "<tool_response>\n5\n</tool_response>" in text
