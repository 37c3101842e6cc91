"""LangChain's own `ChatOpenAI`, bound to a gateway session (needs `tracetrain[langchain]`).

    with LangChainSession("http://127.0.0.1:8000", group_id="task-7") as s:
        llm = s.chat_model("smollm2").bind_tools([calculator])
        reply = llm.invoke("What is 17 * 23?")
        s.reward(0.5, completion_id=s.completion_ids[-1], final=False)   # one call, if you like
        s.reward(1.0)                                                     # the episode: final

The model is the unmodified `ChatOpenAI`: the session is bound by its base URL, so chains, agents and
tools work as they do against OpenAI. The only addition is a callback that remembers the gateway's
`chatcmpl-…` id of each call, because LangChain hides it in metadata and per-call rewards need it.
"""

from __future__ import annotations

import threading
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler, BaseCallbackManager
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_openai import ChatOpenAI
from pydantic import SecretStr

from tracetrain.adapters.session import GatewaySession


class CompletionIds(BaseCallbackHandler):
    """Collects the gateway's completion id of every LLM call it sees, in the order they finish.

    Non-streamed calls carry the id (`llm_output["id"]`, `response_metadata["id"]`); LangChain drops
    it from streamed ones, so those are missing here: read them from `GatewaySession.info()["calls"]`.
    """

    run_inline = True
    """Run in the caller's thread for async code too, so ids arrive in call order."""

    def __init__(self) -> None:
        self.completion_ids: list[str] = []
        self._lock = threading.Lock()

    def on_llm_end(self, response: LLMResult, *, run_id: UUID, parent_run_id: UUID | None = None,
                   **kwargs: Any) -> None:
        found = (response.llm_output or {}).get("id")
        if not found:
            for generations in response.generations:
                for generation in generations:
                    if isinstance(generation, ChatGeneration):
                        found = found or generation.message.response_metadata.get("id")
        if isinstance(found, str) and found.startswith("chatcmpl-"):
            with self._lock:
                self.completion_ids.append(found)


def chat_openai(session: GatewaySession, model: str, **kwargs: Any) -> ChatOpenAI:
    """A `ChatOpenAI` whose calls are recorded in `session` (and its group). Keyword arguments go to
    `ChatOpenAI` (temperature, max_tokens, callbacks, ...); its HTTP clients are the session's, so
    closing the session closes their connections instead of leaving them in LangChain's client cache."""
    kwargs.setdefault("http_client", session.http)
    kwargs.setdefault("http_async_client", session.ahttp)
    return ChatOpenAI(model=model, base_url=session.base_url, api_key=SecretStr(session.api_key),
                      timeout=session.timeout, **kwargs)


class LangChainSession(GatewaySession):
    """A `GatewaySession` that makes LangChain chat models and remembers their completion ids."""

    def __init__(self, gateway_url: str | None = None, *, session_id: str | None = None,
                 group_id: str | None = None, api_key: str | None = None, timeout: float = 600.0) -> None:
        super().__init__(gateway_url, session_id=session_id, group_id=group_id, api_key=api_key, timeout=timeout)
        self.callback = CompletionIds()

    def chat_model(self, model: str, **kwargs: Any) -> ChatOpenAI:
        """`chat_openai(self, model, ...)` with this session's id collector among its callbacks."""
        callbacks = kwargs.get("callbacks")
        if isinstance(callbacks, BaseCallbackManager):
            callbacks.add_handler(self.callback)
        else:
            kwargs["callbacks"] = [self.callback, *(callbacks or [])]
        return chat_openai(self, model, **kwargs)

    @property
    def completion_ids(self) -> list[str]:
        """The `chatcmpl-…` ids of this session's non-streamed calls so far, oldest first."""
        return list(self.callback.completion_ids)
