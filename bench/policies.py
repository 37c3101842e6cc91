"""Named policies (issue 32), in three parts: the trainer's turns between them, what serving them costs, and
whether two of them learn apart.

`scheduler`: which named policy the one trainer steps next when one gets 10× the traffic of another. The
real trainer loop (trainer/loop.py: batch gathering, LoRA step per policy's adapter on one base model,
checkpoint, version record) runs on the tiny random model against a real SQLite store, while a feeder thread
writes finished, rewarded sessions into the store in real time: policy `busy` at ten times the rate of
policy `quiet`, more than the trainer can step, so `busy` always has a batch ready. Each step's line, start
time and sessions are noted; a quiet batch's wait is from the moment its `batch_sessions`-th session was
ready to the start of the step that trained it. It runs twice: with the trainer's `FairScheduler` (least
recently stepped first among lines with a batch ready), and with a greedy rule for contrast (the line with
the most ready sessions first), the rule a trainer that only looks at the queue would follow.

`serving`: one `tracetrain serve` in front of the one vLLM (CPU) it starts, SmolLM2-135M-Instruct with LoRA
and eight named policies, each served its own adapter (written here with peft from a fixed seed, and published
through `POST /v1/policies` as a trainer in another process publishes). Closed-loop load: `--concurrency`
clients stream short chat calls back to back, round-robin over the N active policies by path
(`/p/{policy}/v1/chat/completions`), N in 1, 2, 4, 8, and 0 for the default line with no adapter; the arms
run in rounds, every other round reversed (0 1 2 4 8 8 4 2 1 0 …), so that drift in the machine's load
reaches every arm. Then, under the same load over four policies, new versions are published one after
another (each a new adapter loaded into the running vLLM), and the other policies' traffic while each
publish is in progress is compared with the window before it; the published policy's next calls must
report the new `X-Policy-Version`. The adapters carry the probe a trainer writes beside a checkpoint
(engines/probe.py), but a publish scores it only with `--probe`, as the committed results were measured:
the probe then scored `prompt_logprobs`, which killed vLLM's CPU build beside other LoRA requests.

`learning`: `tracetrain demo --two-policies` over seeds (bench/policy_learning.py says what is measured and
the criteria fixed before the runs): policy `first` rewarded for naming the option asked first, `second` for
the option asked second, on the same questions; each policy's greedy answers on held-out questions before
and after.

    python -m bench.policies --quiet-rate 2                           # every part
    python -m bench.policies --parts serving --seconds 10 --repeats 1  # a quick look at serving
    python -m bench.policies --parts scheduler --seconds 20            # a quick look at the scheduler
    python -m bench.policies --parts learning --seeds 0 1 2            # about a quarter of an hour per seed

The modules: bench/policy_scheduling.py, bench/policy_serving.py and bench/policy_learning.py. One results file,
`bench/results/policies.md`, in parts: a run of some parts keeps the others' sections.
"""

from __future__ import annotations

import argparse
import logging

from bench import policy_learning
from bench.common import add_results_dir_argument, command_line, parts_parser, run_parts
from bench.policy_scheduling import scheduler_part
from bench.policy_serving import ARMS, POLICIES, serving_part

PARTS = {
    "scheduler": "the trainer's turns when one policy gets 10× the traffic of another",
    "serving": "throughput and latency of N active policies on one vLLM, and a publish under load",
    "learning": "two policies on one base model learning opposite rules (SmolLM2 on vLLM, over seeds)",
}


def _arms(text: str) -> list[int]:
    arms = [int(x) for x in text.split(",") if x.strip()]
    if not arms or any(n < 0 or n > len(POLICIES) for n in arms):
        raise argparse.ArgumentTypeError(f"active policies from 0 to {len(POLICIES)}, comma-separated")
    return arms


def _parser() -> argparse.ArgumentParser:
    p = parts_parser("bench.policies", __doc__, PARTS)
    p.add_argument("--seconds", type=float, default=None,
                   help="seconds each scheduler runs (default 60) and each serving run measures (default 25)")
    p.add_argument("--quiet-rate", type=float, default=1.0, help="scheduler: quiet's sessions per second (busy: 10×)")
    p.add_argument("--arms", type=_arms, default=[0, *ARMS],
                   help="serving: active policies per arm (default 0,1,2,4,8; 0 is the default line, no adapter)")
    p.add_argument("--repeats", type=int, default=3, help="serving: rounds over the arms")
    p.add_argument("--concurrency", type=int, default=8, help="serving: closed-loop clients")
    p.add_argument("--warmup", type=float, default=5.0, help="serving: seconds of load before each run's window")
    p.add_argument("--publishes", type=int, default=6, help="serving: versions published under load")
    p.add_argument("--publish-gap", type=float, default=15.0, help="serving: seconds of load between publishes")
    p.add_argument("--probe", action="store_true",
                   help="serving: publishes score the adapter's probe (engine.publish_probe); off by default, as "
                        "the committed results were measured")
    policy_learning.add_arguments(p)
    add_results_dir_argument(p)
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    run_parts("policies", "Named policies: the trainer's turns, the serving cost, learning apart", PARTS,
              {"scheduler": scheduler_part, "serving": serving_part, "learning": policy_learning.part}, args,
              command_line("bench.policies", argv))


if __name__ == "__main__":
    main()
