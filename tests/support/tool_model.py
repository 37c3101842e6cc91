"""A tiny model that really calls a tool: trained here, in seconds, to answer a fixed script.

SmolLM2-135M and a random tiny model rarely emit a well-formed tool call, so tests of tool-call
capture would depend on luck. This model is overfit (greedy decoding reproduces it) on two scripted
conversations: asked to add with a tool it emits a Hermes `<tool_call>`, and given the tool's result
it answers in text. Everything downstream (rendering, parsing, chaining, storage) runs for real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tracetrain.engines.models import cache_root, save_model_dir, tiny_model_dir
from tracetrain.proxy.render import ChatRenderer, canonical_message

ADD_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
QUESTION = "What is 2 + 3? Use the add tool."
TOOL_CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "The answer is 5."
GREETING = ("Hello!", "Hello! How can I help you today?")


def script(call_id: str = "call_1") -> list[dict[str, Any]]:
    """The conversation up to the tool result, as an OpenAI client would send it."""
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "5"},
    ]


def tool_model_dir(steps: int = 80) -> Path:
    target = cache_root() / f"tiny-tool-model-s{steps}-v2"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tiny_model_dir(hidden=128)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    renderer = ChatRenderer(tokenizer)
    end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    canon = [canonical_message(m) for m in script()]
    examples = [
        (renderer.render(canon[:1], [ADD_TOOL], generation=True), TOOL_CALL_TEXT),
        (renderer.render(canon, [ADD_TOOL], generation=True), ANSWER),
        (renderer.render([{"role": "user", "content": GREETING[0]}], None, generation=True), GREETING[1]),
    ]
    sequences = [(prompt, tokenizer.encode(reply, add_special_tokens=False) + end) for prompt, reply in examples]
    overfit(model, sequences, steps=steps, what="tool model")
    return save_model_dir(target, model, tokenizer)


def overfit(model: Any, sequences: list[tuple[list[int], list[int]]], *, steps: int, what: str) -> None:
    """Teach `model` each (prompt ids, reply ids) by heart: AdamW on the reply tokens only, every sequence
    once per step. RuntimeError naming `what` when the last loss is not near zero."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    model.train()
    for _ in range(steps):
        for prompt, reply in sequences:
            ids = torch.tensor([prompt + reply])
            labels = torch.tensor([[-100] * len(prompt) + reply])
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    if loss.item() > 0.05:
        raise RuntimeError(f"{what} did not converge (loss {loss.item():.3f})")
