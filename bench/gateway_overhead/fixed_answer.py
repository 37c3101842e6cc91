"""The fixed upstream's one answer and its responses, serialized once: the upstream's work per request is
then splicing in an id, a timestamp and the echoed prompt, so it stays far cheaper than the gateway."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

LOGPROB = -0.25

DEFAULT_WORDS = "The quick brown fox jumps over the lazy dog while the old cat watches it from the"


@dataclass(frozen=True)
class Answer:
    """The fixed completion: per token its id, the text it adds and its token string."""

    token_ids: tuple[int, ...]
    pieces: tuple[str, ...]
    """Text each token adds to the answer ('' for the EOS, which vLLM skips in `text`)."""
    tokens: tuple[str, ...]
    """The token as vLLM names it in `logprobs.tokens` (the EOS keeps its name, e.g. `<|im_end|>`)."""
    ends_with_eos: bool = True

    @classmethod
    def default(cls) -> Answer:
        words = DEFAULT_WORDS.split()[:15]
        pieces = tuple((" " if i else "") + w for i, w in enumerate(words)) + ("",)
        tokens = pieces[:-1] + ("<|im_end|>",)
        return cls(tuple(range(1000, 1000 + len(words))) + (2,), pieces, tokens, True)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Answer:
        return cls(
            tuple(data["token_ids"]),
            tuple(data["pieces"]),
            tuple(data.get("tokens") or data["pieces"]),
            bool(data.get("ends_with_eos", True)),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "token_ids": list(self.token_ids),
            "pieces": list(self.pieces),
            "tokens": list(self.tokens),
            "ends_with_eos": self.ends_with_eos,
        }

    def finish(self, n: int) -> str:
        return "stop" if n == len(self.token_ids) and self.ends_with_eos else "length"

    def text(self, n: int) -> str:
        return "".join(self.pieces[:n])


def _top(token: str, k: int) -> dict[str, float]:
    """vLLM's top_logprobs entry: the sampled token first, then k alternatives."""
    entry = {token: LOGPROB}
    for j in range(k):
        entry[f"<alt{j}>"] = LOGPROB - 1 - j
    return entry


class Renderer:
    """Pre-serialized pieces of every response shape, cached per (tokens, logprobs, ids) choice."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer

    def _completion_logprobs(self, start: int, end: int, k: int, offset: int) -> dict[str, Any]:
        offsets, tokens = [], []
        for i in range(start, end):
            offsets.append(offset)
            tokens.append(self.answer.tokens[i])
            offset += len(self.answer.tokens[i])
        return {
            "text_offset": offsets,
            "token_logprobs": [LOGPROB] * (end - start),
            "tokens": tokens,
            "top_logprobs": [_top(t, k) for t in tokens],
        }

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one renderer per process, lives as long as it
    def completion_stream_choices(self, n: int, k: int | None, ids: bool) -> tuple[dict[str, Any], Chunks]:
        """The first chunk's choice as a dict (the prompt ids go in per request) and every chunk's
        (choice, tail) bytes; the first chunk's choice bytes are left empty."""
        choices: list[dict[str, Any]] = []
        offset = 0
        for i in range(n):
            last = i == n - 1
            choices.append(
                {
                    "index": 0,
                    "text": self.answer.pieces[i],
                    "logprobs": None if k is None else self._completion_logprobs(i, i + 1, k, offset),
                    "finish_reason": self.answer.finish(n) if last else None,
                    "stop_reason": None,
                    "prompt_token_ids": None,
                    "token_ids": [self.answer.token_ids[i]] if ids else None,
                }
            )
            offset += len(self.answer.tokens[i])
        chunks = tuple(
            (b"" if i == 0 else orjson.dumps(c), FINAL_TAIL if i == n - 1 else TAIL)
            for i, c in enumerate(choices)
        )
        return choices[0], chunks

    @functools.lru_cache(maxsize=256)  # noqa: B019
    def completion_choice(self, n: int, k: int | None, ids: bool) -> dict[str, Any]:
        return {
            "index": 0,
            "text": self.answer.text(n),
            "logprobs": None if k is None else self._completion_logprobs(0, n, k, 0),
            "finish_reason": self.answer.finish(n),
            "stop_reason": None,
            "token_ids": list(self.answer.token_ids[:n]) if ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "routed_experts": None,
        }

    @functools.lru_cache(maxsize=256)  # noqa: B019
    def chat_stream_choices(self, n: int) -> Chunks:
        """The role chunk, then one chunk per token with text, the last one carrying the finish reason."""
        role = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        chunks: list[tuple[bytes, bytes]] = [(orjson.dumps(role), CHAT_FIRST_TAIL)]
        for i, piece in enumerate(self.answer.pieces[:n]):
            last = i == n - 1
            if not piece and not last:
                continue
            choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}, "logprobs": None}
            choice["finish_reason"] = self.answer.finish(n) if last else None
            if last:
                choice["stop_reason"] = None
            choice["token_ids"] = None
            chunks.append((orjson.dumps(choice), TAIL))
        return tuple(chunks)


def usage_json(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


Chunks = tuple[tuple[bytes, bytes], ...]
"""Per SSE chunk: the serialized choice and what follows the choices list."""
FINGERPRINT = "vllm-0.32.0-fixed"
TAIL = b"]}\n\n"
FINAL_TAIL = b'],"system_fingerprint":"' + FINGERPRINT.encode() + b'"}\n\n'
"""vLLM stamps the fingerprint on the terminal chunk when no usage chunk follows."""
CHAT_FIRST_TAIL = b'],"prompt_token_ids":null,"prompt_text":null}\n\n'


def chunk_head(request_id: str, obj: str, created: int, model: Any) -> bytes:
    return (
        b'data: {"id":"'
        + request_id.encode()
        + b'","object":"'
        + obj.encode()
        + b'","created":'
        + str(created).encode()
        + b',"model":'
        + orjson.dumps(model)
        + b',"choices":['
    )


ANSWER_TEXT = (
    "The quick brown fox jumps over the lazy dog while the old cat watches it from the warm "
    "windowsill, and the story goes on and on without end."
)


def answer_in_model_tokens(model_dir: Path, tokens: int) -> dict[str, Any]:
    """An `Answer` as JSON in the model's own token ids, `tokens - 1` text tokens + EOS, so that what the
    gateway decodes, records and chains into the next turn is what the model would have said."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = list(tokenizer.encode(ANSWER_TEXT, add_special_tokens=False))[: tokens - 1]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pieces: list[str] = []
    prev = ""
    for i in range(len(ids)):
        text = str(tokenizer.decode(ids[: i + 1]))
        pieces.append(text[len(prev) :])
        prev = text
    names = [tokenizer.decode([t]) for t in ids]
    return {"token_ids": [*ids, eos], "pieces": [*pieces, ""], "tokens": [*names, "<|im_end|>"], "ends_with_eos": True}
