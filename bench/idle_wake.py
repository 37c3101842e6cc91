"""What the same work costs in CPU when the process sleeps between pieces of it, as a gateway at
concurrency 1 does between calls, against doing it back to back, as at high concurrency.

    python -m bench.idle_wake                        # about 1 minute
    python -m bench.idle_wake --units 3000 --repeats 5

The unit is the gateway's own per-call prompt work (proxy/render.py): render a new 150-word
conversation through SmolLM2's chat template, encode it to token ids, hash its history. Each repeat
runs the arms interleaved, on fresh messages of the same kind: `back to back` runs `--units` units in a
row; `sleep between` sleeps `--sleep-ms` after each (a blocking sleep: the thread leaves the CPU, as an
event loop does waiting in epoll); `busy between` spins for as long instead (the thread keeps its CPU,
and the spin's own CPU is not counted). CPU is this thread's (`time.thread_time`), measured around the
unit alone. If `sleep between` costs more per unit than `back to back` while `busy between` does not,
the difference is what waking costs the work itself on this machine: caches and branch predictors
another task has used meanwhile, a core's clock coming back up, not the gateway's code.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from collections.abc import Callable

from bench.common import ResultTable, console, write_results
from tracetrain.engines.models import smollm2_dir
from tracetrain.proxy.render import ChatRenderer, history_hashes

_numbers = itertools.count(1)
WORDS = ["the", "a", "tool", "call", "result", "agent", "model", "trace", "reward", "session", "policy", "value",
         "search", "query", "answer"]


def conversation(rng: random.Random, words: int) -> list[dict[str, str]]:
    """A system prompt and one new user message of `words` words, one in eight a new number."""
    text = " ".join(f"{rng.choice(WORDS)}{next(_numbers)}" if rng.random() < 0.125 else rng.choice(WORDS)
                    for _ in range(words))
    return [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": text}]


def unit_of_work(renderer: ChatRenderer) -> Callable[[list[dict[str, str]]], None]:
    def unit(messages: list[dict[str, str]]) -> None:
        renderer.encode(renderer.render_text(messages, None, generation=True))
        history_hashes(None, messages)
    return unit


def run_arm(unit: Callable[[list[dict[str, str]]], None], inputs: list[list[dict[str, str]]], mode: str,
            pause_s: float) -> float:
    """CPU µs per unit of this thread, around the units alone."""
    spent = 0.0
    for messages in inputs:
        started = time.thread_time()
        unit(messages)
        spent += time.thread_time() - started
        if mode == "sleep between":
            time.sleep(pause_s)
        elif mode == "busy between":
            until = time.perf_counter() + pause_s
            while time.perf_counter() < until:
                pass
    return 1e6 * spent / len(inputs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.idle_wake", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--units", type=int, default=2000, help="units per arm and repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sleep-ms", type=float, default=2.0, help="pause after each unit (about a call's wait)")
    p.add_argument("--words", type=int, default=150)
    p.add_argument("--output", default="idle_wake")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(smollm2_dir())))
    unit = unit_of_work(renderer)
    rng = random.Random(0)
    for _ in range(500):  # warm the word memory as a running gateway's is
        unit(conversation(rng, args.words))
    modes = ["back to back", "sleep between", "busy between"]
    per_unit: dict[str, list[float]] = {m: [] for m in modes}
    for repeat in range(args.repeats):
        for mode in modes[repeat % 3:] + modes[: repeat % 3]:  # the order rotates every repeat
            inputs = [conversation(rng, args.words) for _ in range(args.units)]
            per_unit[mode].append(run_arm(unit, inputs, mode, args.sleep_ms / 1000))
            console.print(f"repeat {repeat + 1}/{args.repeats} {mode}: {per_unit[mode][-1]:.1f} µs per unit")

    table = ResultTable("CPU per unit of prompt work (render + encode + hash a new 150-word conversation)",
                        ["between units", "µs per unit, median", "min–max over repeats", "vs back to back"])
    base = statistics.median(per_unit["back to back"])
    for mode in modes:
        values = per_unit[mode]
        table.add(mode, f"{statistics.median(values):.1f}", f"{min(values):.1f}–{max(values):.1f}",
                  f"{statistics.median(values) / base:.2f}×")
    console.print(table.rich())
    command = " ".join(["python -m bench.idle_wake", *(sys.argv[1:] if argv is None else argv)])
    notes = [f"{args.repeats} repeats of {args.units} units per arm, interleaved, the order rotating; pause "
             f"{args.sleep_ms:g} ms after each unit; CPU of the measuring thread around each unit alone"]
    path = write_results(args.output, "CPU of the same work with and without sleeping between", command, [table],
                         notes)
    console.print(f"written to {path}")


if __name__ == "__main__":
    main()
