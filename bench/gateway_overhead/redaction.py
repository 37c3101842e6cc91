"""Part `redaction` of `python -m bench.gateway_overhead`: redaction's share of the gateway's work, CPU per call,
and the detectors' table on the test corpus.

    python -m bench.gateway_overhead --parts redaction

The CPU is the serving core's redaction steps for one chat call (proxy/redact.py: the request's messages,
then the reply, the token masks and the state hashes), timed in this process on the same user messages
as the load generator sends (`workload`), against `gateway.redaction: off`, which still hashes the chain. With
`--turns 8` the conversation grows, as an agent's does: every request is redacted whole. The detector
table counts, per type, the corpus's values found (caught), not found (missed) and findings where the
corpus has none of that type (false positives).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from typing import Any

from bench.common import REPO_ROOT, Part, ResultTable, console, provenance, run_started
from bench.gateway_overhead.workload import SYSTEM_PROMPT, Workload
from tracetrain.proxy.redact import chat_states, keep_call, redact_request
from tracetrain.proxy.render import ChatRenderer, canonical_message
from tracetrain.redaction.detectors import TYPES, find
from tracetrain.redaction.redactor import Redactor

CORPUS = REPO_ROOT / "tests" / "data" / "redaction_corpus.jsonl"
REPLY = "Done: I read the file, ran the tests and they pass. The fix is in the retry limit of the cache update."


def detector_table() -> tuple[ResultTable, dict[str, Counter[str]]]:
    counts: dict[str, Counter[str]] = {kind: Counter() for kind in TYPES}
    for line in CORPUS.read_text().splitlines():
        entry = json.loads(line)
        text, expected = entry["text"], Counter((k, v) for k, v in entry["expect"])
        found = Counter((f.kind, text[f.start:f.end]) for f in find(text))
        for (kind, _), n in (expected & found).items():
            counts[kind]["caught"] += n
        for (kind, _), n in (expected - found).items():
            counts[kind]["missed"] += n
        for (kind, _), n in (found - expected).items():
            counts[kind]["false positives"] += n
    table = ResultTable("Detectors on tests/data/redaction_corpus.jsonl", ["type", "caught", "missed",
                                                                         "false positives"])
    for kind in TYPES:
        c = counts[kind]
        table.add(kind, str(c["caught"]), str(c["missed"]), str(c["false positives"]))
    return table, counts


def _conversation(workload: Workload, turns: int, secret: bool, first: int) -> list[list[dict[str, Any]]]:
    """The requests of one session: each the history so far plus a new user message (numbered from `first`,
    so that every session's messages are new, as the load generator's are)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    requests = []
    for n in range(first, first + turns):
        text = workload.user_text(n)
        if secret:
            text += f" Mail ann{n}@example.com, card 4111 1111 1111 1111."
        messages = [*messages, {"role": "user", "content": text}]
        requests.append(messages)
        messages = [*messages, {"role": "assistant", "content": REPLY}]
    return requests


def cpu_per_call(renderer: ChatRenderer, mode: str, sessions: list[list[list[dict[str, Any]]]],
                 reply_ids: list[int]) -> float:
    """Microseconds of CPU per call for the redaction steps of the serving core, over `sessions`."""
    redactor = Redactor(mode)
    reply = {"role": "assistant", "content": REPLY}
    calls = [(sent, renderer.render(sent, None, generation=True)) for requests in sessions for sent in requests]
    started = time.process_time()
    for sent, prompt in calls:
        canonical = [canonical_message(m) for m in sent]
        found = redact_request(redactor, canonical, sent)
        keep_call(redactor, renderer, found, prompt_delta=prompt[-200:], choices=[(REPLY, reply_ids)],
                  replies=[reply], inherited=max(0, len(sent) - 2))
        chat_states(redactor, found, None, canonical, reply)
    return (time.process_time() - started) / len(calls) * 1e6


def redaction_part(args: argparse.Namespace, command: str) -> Part:
    """`--redaction-rounds` sessions of 1 and of 8 turns per mode, on `--prompt-words`-word user messages."""
    started = run_started()
    from transformers import AutoTokenizer

    from tracetrain.engines.models import smollm2_dir

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(smollm2_dir())))
    reply_ids = renderer.encode(REPLY)
    workload = Workload("redaction", 64, args.prompt_words, 1)
    cpu = ResultTable("Redaction CPU per chat call (µs, this process)", ["conversation", "off", "redact",
                                                                        "added", "redact, 2 secrets a message"])
    raw: dict[str, Any] = {"rounds": args.redaction_rounds, "prompt_words": args.prompt_words, "cpu_us": {}}
    for turns in (1, 8):
        t0 = time.perf_counter()
        clean = [_conversation(workload, turns, False, r * turns) for r in range(args.redaction_rounds)]
        dirty = [_conversation(workload, turns, True, r * turns) for r in range(args.redaction_rounds)]
        off = cpu_per_call(renderer, "off", clean, reply_ids)
        on = cpu_per_call(renderer, "redact", clean, reply_ids)
        secrets = cpu_per_call(renderer, "redact", dirty, reply_ids)
        label = "1 turn" if turns == 1 else f"{turns} turns (mean over the turns)"
        cpu.add(label, f"{off:.0f}", f"{on:.0f}", f"{on - off:.0f}", f"{secrets:.0f}")
        raw["cpu_us"][str(turns)] = {"off": off, "redact": on, "redact_secrets": secrets}
        calls = 3 * args.redaction_rounds * turns
        console.log(f"redaction, {turns}-turn sessions: {calls} calls timed, "
                    f"{calls / (time.perf_counter() - t0):.0f} calls/s")
    detectors, counts = detector_table()
    raw["detectors"] = {k: dict(v) for k, v in counts.items()}
    for table in (cpu, detectors):
        console.print(table.rich())
    notes = [f"{args.prompt_words}-word user messages from the load generator's workload, a {len(reply_ids)}-token "
             "reply; `off` hashes the chain only, as every call does.",
             "Accepted: national phone numbers without a country code are missed; short base64 blobs and "
             "four-part version numbers are false positives (tests/unit/test_redaction_detectors.py)."]
    return Part("redaction", command, provenance(started), [cpu, detectors], notes, raw)
