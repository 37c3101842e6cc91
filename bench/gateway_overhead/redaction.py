"""Redaction's share of the gateway's work: CPU per call, and the detectors' table on the test corpus.

    python -m bench.gateway_overhead.redaction

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
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, ResultTable, console, run_started, write_results
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--prompt-words", type=int, default=150)
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args()
    started = run_started()
    from transformers import AutoTokenizer

    from tracetrain.engines.models import smollm2_dir

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(smollm2_dir())))
    reply_ids = renderer.encode(REPLY)
    workload = Workload("redaction", 64, args.prompt_words, 1)
    cpu = ResultTable("Redaction CPU per chat call (µs, this process)", ["conversation", "off", "redact",
                                                                        "added", "redact, 2 secrets a message"])
    raw: dict[str, Any] = {"cpu_us": {}}
    for turns in (1, 8):
        clean = [_conversation(workload, turns, False, r * turns) for r in range(args.rounds)]
        dirty = [_conversation(workload, turns, True, r * turns) for r in range(args.rounds)]
        off = cpu_per_call(renderer, "off", clean, reply_ids)
        on = cpu_per_call(renderer, "redact", clean, reply_ids)
        secrets = cpu_per_call(renderer, "redact", dirty, reply_ids)
        label = "1 turn" if turns == 1 else f"{turns} turns (mean over the turns)"
        cpu.add(label, f"{off:.0f}", f"{on:.0f}", f"{on - off:.0f}", f"{secrets:.0f}")
        raw["cpu_us"][str(turns)] = {"off": off, "redact": on, "redact_secrets": secrets}
    detectors, counts = detector_table()
    raw["detectors"] = {k: dict(v) for k, v in counts.items()}
    for table in (cpu, detectors):
        console.print(table.rich())
    kwargs = {"results_dir": args.results_dir} if args.results_dir else {}
    notes = [f"{args.prompt_words}-word user messages from the load generator's workload, a {len(reply_ids)}-token "
             "reply; `off` hashes the chain only, as every call does.",
             "Accepted: national phone numbers without a country code are missed; short base64 blobs and "
             "four-part version numbers are false positives (tests/unit/test_redaction_detectors.py)."]
    write_results("redaction", "Redaction: CPU per call and detectors", "python -m bench.gateway_overhead.redaction",
                  [cpu, detectors], notes, raw=raw, started=started, **kwargs)


if __name__ == "__main__":
    main()
