"""The OpenAI SDK bound to a gateway session.

    with OpenAISession("http://127.0.0.1:8000", group_id="task-7") as s:
        reply = s.client.chat.completions.create(model="smollm2", messages=[...])
        s.reward(1.0)

`s.client` / `s.async_client` are the SDK's own `OpenAI` / `AsyncOpenAI`, pointed at the session's
URL; everything else about them is the SDK's.
"""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI, OpenAI

from tracetrain.adapters.session import GatewaySession


class OpenAISession(GatewaySession):
    """A `GatewaySession` with OpenAI clients. Extra keyword arguments go to the SDK clients."""

    def __init__(self, gateway_url: str | None = None, *, session_id: str | None = None,
                 group_id: str | None = None, api_key: str | None = None, timeout: float = 600.0,
                 **client_kwargs: Any) -> None:
        super().__init__(gateway_url, session_id=session_id, group_id=group_id, api_key=api_key, timeout=timeout)
        self.client_kwargs = client_kwargs
        self._client: OpenAI | None = None
        self._async_client: AsyncOpenAI | None = None

    @property
    def client(self) -> OpenAI:
        if self._client is None:
            self._client = OpenAI(base_url=self.base_url, api_key=self.api_key, timeout=self.timeout,
                                  **self.client_kwargs)
        return self._client

    @property
    def async_client(self) -> AsyncOpenAI:
        if self._async_client is None:
            self._async_client = AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, timeout=self.timeout,
                                             **self.client_kwargs)
        return self._async_client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        super().close()

    async def aclose(self) -> None:
        if self._async_client is not None:
            await self._async_client.close()
            self._async_client = None
        await super().aclose()


def session(gateway_url: str | None = None, **kwargs: Any) -> OpenAISession:
    """Shorthand for `OpenAISession(gateway_url, **kwargs)`."""
    return OpenAISession(gateway_url, **kwargs)
