"""Constrained JSON that neither pads nor loops: the gateway's whitespace bound against direct vLLM.

One vLLM CPU server (SmolLM2-135M-Instruct, started with no structured-output flags, as a user
starts it) and three gateways in front of it that differ only in `json_max_whitespace`:

- `direct`: vLLM's own `/v1/chat/completions` with `response_format: json_schema` (free whitespace);
- `gw free`: the gateway passing the schema as it is (`json_max_whitespace: null`: free whitespace);
- `gw before`: what the gateway did before, a second vLLM server started with the server-wide
  `disable_any_whitespace` and the schema passed as it is (compact JSON);
- `gw ws<=N`: at most N consecutive whitespace characters (`--bounds`).

Cases: `response_format` schemas, and forced tool calls (`tool_choice` naming the tool; gateway arms
only: SmolLM2's own chat template has no tools, so vLLM alone cannot render the same prompt). Each
case greedy and sampled at temperature 1 with each seed; arms in rotated order per request.

The metric, fixed before the run: an answer is **good** when it parses, satisfies its schema and was
ended by the grammar (`finish_reason` not `length`). Also: hit `max_tokens` (the padding or looping
failure) and median completion tokens.

    python -m bench.constrained_json --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from bench.common import ResultTable, ServerProcess, console, free_port, machine_line, python_cmd, write_results

MODEL = "smollm2-135m-instruct"
JOKE = {  # LangChain's with_structured_output(Joke) for `class Joke(BaseModel)` with two described fields
    "title": "Joke", "description": "Joke to tell user.", "type": "object",
    "properties": {"setup": {"description": "The setup of the joke", "type": "string"},
                   "punchline": {"description": "The punchline to the joke", "type": "string"}},
    "required": ["setup", "punchline"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "email": {"type": "string"}}, "required": ["name", "age", "email"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
RECIPE = {"type": "object", "properties": {
    "dish": {"type": "string"},
    "ingredients": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 6},
    "minutes": {"type": "integer", "minimum": 1}}, "required": ["dish", "ingredients", "minutes"]}
ORDER = {"type": "object", "properties": {
    "customer": {"type": "object", "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
                 "required": ["name", "vip"]},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["sku", "qty"]}, "maxItems": 3}},
    "required": ["customer", "items"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
SEARCH = {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
          "required": ["query"]}


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str
    schema: dict[str, Any]
    tool: str | None = None
    """A forced call of this tool instead of `response_format`."""


CASES = [
    Case("joke", "Tell me a joke about cats.", JOKE),
    Case("person", "Describe a fictional person.", PERSON),
    Case("weather", "What's the weather like in Paris?", WEATHER),
    Case("recipe", "Give me a quick pancake recipe.", RECIPE),
    Case("order", "Alice, a VIP, orders two apples and a pear. Record the order.", ORDER),
    Case("tool add", "What is 17 plus 25?", ADD, tool="add"),
    Case("tool search", "Find recent news about the Mars rover.", SEARCH, tool="search"),
]


def request(case: Case, temperature: float, seed: int | None, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": case.prompt}],
                            "temperature": temperature, "max_tokens": max_tokens}
    if seed is not None:
        body["seed"] = seed
    if case.tool:
        body["tools"] = [{"type": "function", "function": {"name": case.tool, "parameters": case.schema}}]
        body["tool_choice"] = {"type": "function", "function": {"name": case.tool}}
    else:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": case.name, "schema": case.schema, "strict": True}}
    return body


@dataclass
class Answer:
    good: bool
    cut: bool
    tokens: int
    text: str


def judge(case: Case, data: dict[str, Any]) -> Answer:
    choice = data["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    text = calls[0]["function"]["arguments"] if case.tool and calls else choice["message"].get("content") or ""
    cut = choice["finish_reason"] == "length"
    try:
        jsonschema.validate(json.loads(text), case.schema)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    return Answer(valid and not cut, cut, int(data["usage"]["completion_tokens"]), text)


def start_gateway(upstream: str, model_dir: Path, max_whitespace: int | None, tmp: Path) -> ServerProcess:
    port = free_port()
    setting = "null" if max_whitespace is None else str(max_whitespace)
    cmd = python_cmd("-m", "tracetrain.cli", "serve", "--engine", "vllm", "--engine-url", upstream,
                     "--model", str(model_dir), "--served-model-name", MODEL, "--port", str(port),
                     "--db-url", f"sqlite:///{tmp / f'gw{port}.db'}", "--set", f"json_max_whitespace={setting}")
    return ServerProcess(f"gateway-ws-{setting}", cmd, f"http://127.0.0.1:{port}").start(timeout=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.constrained_json", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the sampled runs")
    p.add_argument("--bounds", type=int, nargs="+", default=[4, 12], help="json_max_whitespace of the bounded arms")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--output", default="constrained_json")
    args = p.parse_args(argv)

    from tracetrain.engines.models import smollm2_dir
    from tracetrain.engines.vllm_server import VLLMServer

    model_dir = smollm2_dir()
    tmp = Path(tempfile.mkdtemp(prefix="tt-json-"))
    arms: dict[str, int | None] = {"gw free": None, **{f"gw ws<={n}": n for n in args.bounds}, "gw before": None}
    answers: dict[tuple[str, str], list[Answer]] = {}
    examples: dict[tuple[str, str], str] = {}
    console.print(machine_line())
    # Over TCP: the direct arm sends its requests to the server's URL.
    server = VLLMServer(model_dir, served_model_name=MODEL, max_model_len=2048, listen="tcp")
    compact = VLLMServer(model_dir, served_model_name=MODEL, max_model_len=2048, listen="tcp", extra_args=[
        "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}'])
    gateways: dict[str, ServerProcess] = {}
    try:
        with console.status("starting two vLLM servers…"):
            for s in (server, compact):
                s.launch()
            for s in (server, compact):
                s.wait_healthy()
        for arm, bound in arms.items():
            gateways[arm] = start_gateway((compact if arm == "gw before" else server).url, model_dir, bound, tmp)
        urls = {"direct": server.url, **{arm: gw.url for arm, gw in gateways.items()}}
        runs: list[tuple[float, int | None]] = [(0.0, None), *((1.0, s) for s in args.seeds)]
        total = len(CASES) * len(runs)
        with httpx.Client(timeout=600) as client:
            for n, (case, (temperature, seed)) in enumerate((c, r) for c in CASES for r in runs):
                order = list(urls)[n % len(urls):] + list(urls)[: n % len(urls)]
                for arm in order:
                    if arm == "direct" and case.tool:
                        continue
                    reply = client.post(urls[arm] + "/v1/chat/completions",
                                        json=request(case, temperature, seed, args.max_tokens))
                    if reply.status_code != 200:
                        raise SystemExit(f"{arm} answered {reply.status_code} on {case.name}: {reply.text[:500]}")
                    answer = judge(case, reply.json())
                    answers.setdefault((case.name, arm), []).append(answer)
                    if seed is None:
                        examples[(case.name, arm)] = answer.text
                console.log(f"{n + 1}/{total} {case.name} T={temperature:g} seed={seed}: "
                            + ", ".join(f"{a} {'ok' if answers[(case.name, a)][-1].good else 'BAD'}"
                                        for a in order if (case.name, a) in answers))
    finally:
        for gw in gateways.values():
            gw.stop()
        server.stop()
        compact.stop()

    arm_names = ["direct", *arms]
    table = ResultTable("Good answers (parsed, schema-valid, ended by the grammar) / hit max_tokens / median tokens",
                        ["case", *arm_names])
    for case in CASES:
        row = [case.name]
        for arm in arm_names:
            got = answers.get((case.name, arm))
            row.append("n/a" if not got else f"{sum(a.good for a in got)}/{len(got)} · {sum(a.cut for a in got)} cut"
                       f" · {statistics.median(a.tokens for a in got):.0f} tok")
        table.add(*row)
    totals = ResultTable("All cases", ["arm", "good", "hit max_tokens", "response_format cases good"])
    for arm in arm_names:
        got = [a for (_, name), values in answers.items() if name == arm for a in values]
        rf = [a for (case, name), values in answers.items() if name == arm and not case.startswith("tool")
              for a in values]
        totals.add(arm, f"{sum(a.good for a in got)}/{len(got)}", sum(a.cut for a in got),
                   f"{sum(a.good for a in rf)}/{len(rf)}")
    greedy = ResultTable("Greedy answers (first 90 characters)", ["case", "arm", "text"], right_align_from=3)
    for (case_name, arm), text in examples.items():
        greedy.add(case_name, arm, repr(text[:90]).replace("\\n", "⏎"))
    tables = [table, totals, greedy]
    for t in tables:
        console.print(t.rich())
    notes = [f"each case greedy once and at temperature 1 with seeds {args.seeds}; max_tokens {args.max_tokens}",
             "direct: vLLM's own chat completions (its chat template, response_format as vLLM enforces it with "
             "free whitespace); the gateway renders the same template itself",
             "tool cases: `tool_choice` names the tool; arguments judged against its parameter schema"]
    command = " ".join(["python -m bench.constrained_json", *(argv if argv is not None else sys.argv[1:])])
    path = write_results(args.output, "Constrained JSON: whitespace bound vs direct vLLM", command, tables, notes)
    console.print(f"written to {path}")


if __name__ == "__main__":
    main()
