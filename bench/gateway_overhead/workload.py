"""What the load generator's clients send: user messages, conversations and their sessions."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from bench.gateway_overhead.apis import Api, Turn

MODEL_NAME = "smollm2-135m-instruct"
"""The name the gateway serves and the upstream answers to (vLLM's `--served-model-name`)."""
WORDS = [
    "agent", "tool", "call", "result", "search", "file", "read", "write", "plan", "step", "check", "answer",
    "question", "model", "token", "prompt", "reward", "session", "trace", "store", "batch", "query", "table",
    "index", "value", "error", "retry", "limit", "cache", "update", "version", "policy", "train", "sample",
    "score", "review", "branch", "merge", "commit", "deploy", "build", "test",
]
SYSTEM_PROMPT = (
    "You are a careful coding agent. Think step by step, call tools when they help, and "
    "answer concisely. Never invent file contents; read them first."
)


@dataclass
class Workload:
    tag: str
    """Unique per run, so that session ids never collide with an earlier run's."""
    max_tokens: int
    prompt_words: int
    turns: int
    """Requests per session: 1 for unique sessions."""
    temperature: float | None = None
    long_answer_prompt: bool = False
    """vLLM: ask for a long text, so both paths run to max_tokens rather than an early EOS."""

    def user_text(self, n: int) -> str:
        # One word in eight carries a number never sent before ("trace48213"), as ids, paths and counts do
        # in agents' messages: the gateway remembers words it has encoded (proxy/segments.py), and a
        # message of 42 words seen before would measure that cache, not the encoding.
        words = [WORDS[(n * 7 + i * 13) % len(WORDS)] + (str(n * 1009 + i) if i % 8 == 7 else "")
                 for i in range(self.prompt_words)]
        lead = "Write a long story about these words, never stopping: " if self.long_answer_prompt else ""
        return f"{lead}Request {n}: " + " ".join(words)


_session_numbers = itertools.count()
_request_numbers = itertools.count()


class Conversation:
    """The messages one client sends: a new session every `turns` requests."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.session = ""
        self.turns: list[Turn] = []
        self.turn = 0
        self._new()

    def _new(self) -> None:
        self.session = f"{self.workload.tag}-{next(_session_numbers)}"
        self.turns = [("user", self.workload.user_text(next(_request_numbers)))]
        self.turn = 0

    def body(self, api: Api, stream: bool) -> dict[str, Any]:
        """The conversation so far in `api`'s request shape (the system prompt where that API puts it)."""
        body = api.body(SYSTEM_PROMPT, self.turns, self.workload.max_tokens, stream, self.workload.temperature)
        body["model"] = MODEL_NAME
        return body

    def advance(self, reply_text: str) -> None:
        """Send the reply back with a new user message next time (the gateway extends its token chain),
        or start a new session once this one has had its turns."""
        self.turn += 1
        if self.turn >= self.workload.turns:
            self._new()
            return
        self.turns = [*self.turns, ("assistant", reply_text), ("user", self.workload.user_text(next(_request_numbers)))]
