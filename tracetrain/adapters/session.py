"""A session at the gateway, independent of any agent framework: its URLs and its rewards.

The framework adapters (`openai`, `langchain`, `agentscope`) build their clients on this. All a
framework needs is the base URL `…/s/{session}/g/{group}/v1`: the path binds every call made through
it, so the framework's own classes are used unchanged.
"""

from __future__ import annotations

import os
import uuid
from types import TracebackType
from typing import Any, Self

import httpx

DEFAULT_GATEWAY = "http://127.0.0.1:8000"


def gateway_root(url: str | None = None) -> str:
    """The gateway root from `url`, `TRACETRAIN_GATEWAY_URL` or the default; a `/v1` suffix is dropped."""
    root = url or os.environ.get("TRACETRAIN_GATEWAY_URL") or DEFAULT_GATEWAY
    return root.rstrip("/").removesuffix("/v1")


class GatewaySession:
    """One agent session (episode): the calls made through `base_url`, and the rewards posted for them.

    `session_id` defaults to a fresh random id; `group_id` puts sessions that attempt the same task
    together (GRPO/RLOO compare rewards within a group). `api_key` is the gateway's agent key (any
    string when the gateway runs without keys); it defaults to `OPENAI_API_KEY`.
    """

    def __init__(
        self,
        gateway_url: str | None = None,
        *,
        session_id: str | None = None,
        group_id: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
    ) -> None:
        self.gateway_url = gateway_root(gateway_url)
        self.session_id = session_id or f"s-{uuid.uuid4().hex}"
        self.group_id = group_id
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY") or "tracetrain"
        self.timeout = timeout
        self._http: httpx.Client | None = None
        self._ahttp: httpx.AsyncClient | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI base URL that binds calls to this session (and group)."""
        group = f"/g/{self.group_id}" if self.group_id else ""
        return f"{self.gateway_url}/s/{self.session_id}{group}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def http(self) -> httpx.Client:
        if self._http is None:
            self._http = httpx.Client(base_url=self.gateway_url, headers=self.headers, timeout=self.timeout)
        return self._http

    @property
    def ahttp(self) -> httpx.AsyncClient:
        if self._ahttp is None:
            self._ahttp = httpx.AsyncClient(base_url=self.gateway_url, headers=self.headers, timeout=self.timeout)
        return self._ahttp

    def _reward_body(self, value: float | dict[str, float], final: bool, completion_id: str | None,
                     choice_index: int, idempotency_key: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"reward": value, "final": final}
        if completion_id:
            body.update(completion_id=completion_id, choice_index=choice_index)
        else:
            body["session_id"] = self.session_id
        if idempotency_key:
            body["idempotency_key"] = idempotency_key
        return body

    def reward(self, value: float | dict[str, float], *, final: bool = True, completion_id: str | None = None,
               choice_index: int = 0, idempotency_key: str | None = None) -> dict[str, Any]:
        """Post a reward for the session, or for one call by its `chatcmpl-…` id. `final=True` marks the
        episode as finished, so the trainer may take it. Raises `httpx.HTTPStatusError` on rejection."""
        body = self._reward_body(value, final, completion_id, choice_index, idempotency_key)
        return _checked(self.http.post("/v1/rewards", json=body))

    async def areward(self, value: float | dict[str, float], *, final: bool = True,
                      completion_id: str | None = None, choice_index: int = 0,
                      idempotency_key: str | None = None) -> dict[str, Any]:
        """`reward` for async code."""
        body = self._reward_body(value, final, completion_id, choice_index, idempotency_key)
        return _checked(await self.ahttp.post("/v1/rewards", json=body))

    def info(self) -> dict[str, Any]:
        """What the gateway recorded: the session's calls, rewards and status."""
        return _checked(self.http.get(f"/v1/sessions/{self.session_id}"))

    def trajectory(self) -> dict[str, Any]:
        """Token ids, loss mask, behaviour logprobs and segments of the session."""
        return _checked(self.http.get(f"/v1/sessions/{self.session_id}/trajectory"))

    def close(self) -> None:
        """Close the HTTP clients this session opened (the session itself stays in the store)."""
        if self._http is not None:
            self._http.close()
            self._http = None

    async def aclose(self) -> None:
        self.close()
        if self._ahttp is not None:
            await self._ahttp.aclose()
            self._ahttp = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


def _checked(response: httpx.Response) -> dict[str, Any]:
    response.raise_for_status()
    return response.json()  # type: ignore[no-any-return]
