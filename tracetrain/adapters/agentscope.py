"""AgentScope 2's own `OpenAIChatModel`, bound to a gateway session (needs `tracetrain[agentscope]`).

    async with AgentScopeSession("http://127.0.0.1:8000", group_id="task-7") as s:
        agent = Agent(name="assistant", system_prompt="...", model=s.chat_model("smollm2"), toolkit=toolkit,
                      middlewares=[s.middleware, ForceToolChoice("search")])
        reply = await agent.reply(UserMsg("user", "Who wrote Dune?"))
        await s.areward(0.5, completion_id=s.completion_ids[0], final=False)   # one call, if you like
        await s.areward(1.0)                                                    # the episode: final

The model is the unmodified `OpenAIChatModel`: the session is bound by its base URL, so `Agent`, its
`Toolkit`, state and formatter work as they do against OpenAI, streamed or not. Two additions, both
AgentScope middlewares (its own extension point for agents):

- `CompletionIds` (`s.middleware`) remembers the gateway's `chatcmpl-…` id of every model call, because
  AgentScope 2 keeps it only on the `ChatResponse` (a reply `Msg` gathers all steps under its own id),
  and per-call rewards need it.
- `ForceToolChoice` sets `tool_choice` for the first reasoning steps of each reply. `Agent` sends none
  of its own until a structured output or the tool-less summary after `max_iters` needs one, and a small
  model being trained may never call a tool on its own; forcing the first steps, which a vLLM-backed
  gateway enforces by constrained decoding, gives it well-formed calls to learn from.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

from agentscope.agent import Agent
from agentscope.credential import OpenAICredential
from agentscope.middleware import MiddlewareBase
from agentscope.model import ChatResponse, OpenAIChatModel
from agentscope.tool import ToolChoice
from pydantic import SecretStr

from tracetrain.adapters.session import GatewaySession


def openai_chat_model(session: GatewaySession, model: str, **kwargs: Any) -> OpenAIChatModel:
    """An `OpenAIChatModel` whose calls are recorded in `session` (and its group).

    Keyword arguments go to `OpenAIChatModel` (`parameters=OpenAIChatModel.Parameters(temperature=…,
    max_tokens=…)`, `stream=False`, …); `client_kwargs` are merged over the session's. The OpenAI client
    uses the session's async HTTP client, so `await session.aclose()` closes its connections.
    """
    credential = OpenAICredential(api_key=SecretStr(session.api_key), base_url=session.base_url)
    client_kwargs: dict[str, Any] = {"timeout": session.timeout, "http_client": session.ahttp,
                                     **(kwargs.pop("client_kwargs", None) or {})}
    return OpenAIChatModel(credential=credential, model=model, client_kwargs=client_kwargs, **kwargs)


class CompletionIds(MiddlewareBase):
    """Collects the gateway's completion id of every model call of the agents it is given to, in call order.

    Streamed calls too: AgentScope's stream wrapper ends with the accumulated response, which carries the
    id of the chunks. Ids that are not the gateway's (`chatcmpl-…`; AgentScope makes up one when a
    response has none) are skipped.
    """

    def __init__(self) -> None:
        self.completion_ids: list[str] = []

    def _record(self, response: ChatResponse) -> None:
        if response.is_last and response.id.startswith("chatcmpl-"):
            self.completion_ids.append(response.id)

    async def on_model_call(
        self, agent: Agent, input_kwargs: dict[str, Any],
        next_handler: Callable[..., Any],
    ) -> ChatResponse | AsyncGenerator[ChatResponse, None]:
        result = await next_handler()
        if isinstance(result, ChatResponse):
            self._record(result)
            return result
        return self._stream(result)

    async def _stream(self, chunks: AsyncGenerator[ChatResponse, None]) -> AsyncGenerator[ChatResponse, None]:
        try:
            async for chunk in chunks:
                self._record(chunk)
                yield chunk
        finally:
            await chunks.aclose()


class ForceToolChoice(MiddlewareBase):
    """Make reasoning step k of every reply use `tool_choice=choices[k]` (a tool name, "required", "none",
    "auto", a `ToolChoice`, or None to leave it to the agent); later steps keep the agent's own choice.

    `ForceToolChoice("search")` forces a search first and lets the model go on freely;
    `ForceToolChoice("search", "none")` also makes the second step a plain answer, so a reply is exactly
    two calls. The step is the agent's own reasoning-acting round (`agent.state.cur_iter`, 0 at the start
    of each reply), so one instance serves any number of agents. A step where the agent sets a
    `tool_choice` itself (its structured-output tool, its tool-less summary after `max_iters`) keeps it.
    """

    def __init__(self, *choices: str | ToolChoice | None) -> None:
        self.choices = [ToolChoice(mode=c) if isinstance(c, str) else c for c in choices]

    async def on_reasoning(
        self, agent: Agent, input_kwargs: dict[str, Any], next_handler: Callable[..., AsyncGenerator[Any, None]],
    ) -> AsyncGenerator[Any, None]:
        step = agent.state.cur_iter
        choice = input_kwargs.get("tool_choice")
        if choice is None and step < len(self.choices):
            choice = self.choices[step]
        async for item in next_handler(tool_choice=choice):
            yield item


class AgentScopeSession(GatewaySession):
    """A `GatewaySession` that makes AgentScope chat models bound to it and, through `middleware`,
    remembers their completion ids. Use it with `async with` (or `await s.aclose()`) so the models'
    connections are closed with the session."""

    def __init__(self, gateway_url: str | None = None, *, session_id: str | None = None,
                 group_id: str | None = None, api_key: str | None = None, timeout: float = 600.0) -> None:
        super().__init__(gateway_url, session_id=session_id, group_id=group_id, api_key=api_key, timeout=timeout)
        self.middleware = CompletionIds()
        """Pass it to `Agent(middlewares=[...])` to fill `completion_ids`."""

    def chat_model(self, model: str, **kwargs: Any) -> OpenAIChatModel:
        """`openai_chat_model(self, model, ...)`: pass it to `Agent(model=...)`."""
        return openai_chat_model(self, model, **kwargs)

    @property
    def completion_ids(self) -> list[str]:
        """The `chatcmpl-…` ids of the calls made by agents holding `self.middleware`, oldest first."""
        return list(self.middleware.completion_ids)
