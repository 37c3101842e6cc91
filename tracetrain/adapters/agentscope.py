"""AgentScope's own `OpenAIChatModel`, bound to a gateway session (needs `tracetrain[agentscope]`).

    async with AgentScopeSession("http://127.0.0.1:8000", group_id="task-7") as s:
        agent = ReActAgent(name="assistant", sys_prompt="...", model=s.chat_model("smollm2"),
                           formatter=OpenAIChatFormatter(), toolkit=toolkit)
        reply = await agent(Msg("user", "Who wrote Dune?", "user"))
        await s.areward(1.0)           # one call: s.areward(0.5, completion_id=msg.invocation_id, final=False)

The model is the unmodified `OpenAIChatModel`: the session is bound by its base URL, so `ReActAgent`,
its `Toolkit`, memory and formatter work as they do against OpenAI. AgentScope keeps the gateway's
`chatcmpl-…` id of every reply in `Msg.invocation_id`, so per-call rewards need no extra bookkeeping.

`force_tool_choice` is the one addition: `ReActAgent` sends no `tool_choice` by itself (only
"required" while a structured output is pending), and a small model being trained may never call a
tool on its own. Forcing the first steps of each reply, which a vLLM-backed gateway enforces by
constrained decoding, gives it well-formed calls to learn from.
"""

from __future__ import annotations

from typing import Any

from agentscope.agent import ReActAgent
from agentscope.model import OpenAIChatModel

from tracetrain.adapters.session import GatewaySession


def openai_chat_model(session: GatewaySession, model: str, **kwargs: Any) -> OpenAIChatModel:
    """An `OpenAIChatModel` whose calls are recorded in `session` (and its group).

    Keyword arguments go to `OpenAIChatModel` (`generate_kwargs={"temperature": …}`, …); `client_kwargs`
    are merged over the session's. The OpenAI client uses the session's async HTTP client, so
    `await session.aclose()` closes its connections. `stream` defaults to False, unlike AgentScope:
    its 1.0.x stream parser tests `"data" in delta.audio`, which raises on every chunk with openai SDKs
    whose `ChoiceDelta` declares `audio` (None when absent); the recorded tokens are the same either way.
    """
    kwargs.setdefault("stream", False)
    client_kwargs: dict[str, Any] = {"base_url": session.base_url, "timeout": session.timeout,
                                     "http_client": session.ahttp, **(kwargs.pop("client_kwargs", None) or {})}
    return OpenAIChatModel(model_name=model, api_key=session.api_key, client_kwargs=client_kwargs, **kwargs)


def force_tool_choice(agent: ReActAgent, *choices: str | None) -> None:
    """Make reasoning step k of every reply use `tool_choice=choices[k]` (a tool name, "required",
    "none", "auto" or None to leave it to the agent); later steps keep the agent's own choice.

    `force_tool_choice(agent, "search")` forces a search first and lets the model go on freely;
    `force_tool_choice(agent, "search", "none")` also makes the second step a plain answer, so a reply
    is exactly two calls. Implemented with AgentScope's own hooks (`pre_reply`, `pre_reasoning`).
    """
    step = 0

    def reset(_agent: Any, kwargs: dict[str, Any]) -> None:
        nonlocal step
        step = 0

    def choose(_agent: Any, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        nonlocal step
        step += 1
        if step > len(choices) or choices[step - 1] is None:
            return None
        return {**kwargs, "tool_choice": choices[step - 1]}

    agent.register_instance_hook("pre_reply", "tracetrain_tool_choice", reset)
    agent.register_instance_hook("pre_reasoning", "tracetrain_tool_choice", choose)


class AgentScopeSession(GatewaySession):
    """A `GatewaySession` that makes AgentScope chat models bound to it. Use it with `async with`
    (or `await s.aclose()`) so the models' connections are closed with the session."""

    def chat_model(self, model: str, **kwargs: Any) -> OpenAIChatModel:
        """`openai_chat_model(self, model, ...)`: pass it to `ReActAgent(model=...)`."""
        return openai_chat_model(self, model, **kwargs)
