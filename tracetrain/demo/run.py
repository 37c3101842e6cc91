"""`tracetrain demo`: agents learn from their own traffic, live, on this machine.

1. `tracetrain serve --train` starts vLLM on CPU (SmolLM2-135M-Instruct), the gateway and the trainer.
2. The unmodified arithmetic agent (`tracetrain.demo.arithmetic`) is evaluated on held-out sums, greedy.
   Held out by construction: the sums are split once on the unordered pair {a, b}, and training
   episodes draw only from the training part, in either order (see `tracetrain.demo.arithmetic`).
3. Agents run through the gateway for a while, posting rule-based rewards; the trainer turns them into
   new weights and hot-swaps them into vLLM while the agents keep going. The terminal shows the reward
   of every policy version as it happens.
4. The same held-out evaluation again; a PNG plots reward against time and policy version.

Every part is a separate process talking HTTP, as it would be for a user.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.live import Live
from rich.table import Table

from tracetrain.config import parse_set
from tracetrain.demo import two_policies as two_policies_demo
from tracetrain.engines.vllm_server import die_with_parent

AGENTS = {"arithmetic": "tracetrain.demo.arithmetic", "tools": "tracetrain.demo.tool_agent"}
"""The agent runs as its own process, talking HTTP to the gateway like any user's agent: the OpenAI SDK
answering sums in one turn, or a LangChain agent adding numbers with a tool over several turns."""
console = Console()

DEMO_TRAINING = {
    "advantage": "rloo", "policy_loss": "vanilla", "lora": True, "lora_rank": 16, "lora_alpha": 32,
    "lr": 1e-4, "batch_sessions": 32, "min_sessions": 32, "max_staleness": 1, "mode": "sync",
    "micro_batch_tokens": 1024, "tis_cap": 2.0, "publish": "reload", "flat_groups": "set_aside",
}
"""LoRA makes a step cheaper than full fine-tuning; each adapter is merged and reloaded as full weights
because vLLM on CPU serves an adapter at half the speed of plain weights. `sync`: on 2 cores,
generation and training compete for the same CPU, so agents wait while a batch trains.

The estimator and the lr were chosen on the validation split, never the test sums, by the rule in
bench/demo_choice.py: rloo or grpo, lr 1e-4 or 2e-4, two seeds each. rloo at 1e-4 is the one combination
whose validation curve never fell more than 0.05 below its best so far on either seed (0.029 at most),
ending at 0.538; the others rose higher at times but fell back by 0.08 to 0.12 on the way
(bench/results/demo_choice.md). Our reading, not a proof: a step covers only 4 problems (32 sessions in
groups of 8), so each step's gradient is noisy, and the larger step, or grpo's division by each group's
reward spread, lets that noise undo earlier gains. All-equal groups are set aside, as they were when
these settings were chosen (the trainer's default has since become `baseline`, chosen on a hard task with
every other setting at its default)."""


def _write_config(out: Path, port: int, vllm_port: int, engine: str, overrides: dict[str, Any],
                  two_policies: bool = False) -> Path:
    """The demo's config file: its settings, group by group, under `overrides` (`parse_set`'s shape).
    `two_policies`: the policies of `tracetrain.demo.two_policies`, whose versions cannot be merged and
    reloaded (that would put one policy's weights under every call)."""
    config: dict[str, dict[str, Any]] = {
        "engine": {"kind": engine, "vllm_port": vllm_port},
        "store": {"url": f"sqlite:///{(out / 'store.db').resolve()}"},
        "gateway": {"port": port, "log_level": "INFO"},
        "train": {**DEMO_TRAINING, "checkpoint_dir": str((out / "checkpoints").resolve())},
    }
    if two_policies:
        config["gateway"]["policies"] = two_policies_demo.GATEWAY_POLICIES
        config["train"]["publish"] = "auto"  # each version its own adapter in vLLM, swapped in place in-process
    for group, settings in overrides.items():
        config[group] = {**config.get(group, {}), **settings}
    path = out / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 900) -> None:
    started = time.monotonic()
    next_note = started + 15
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            raise SystemExit(f"the gateway exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > next_note:
            console.print(f"  starting vLLM and the gateway… {time.monotonic() - started:.0f}s")
            next_note += 15
        time.sleep(1)
    raise SystemExit("the gateway did not become healthy in time")


def _agent(name: str, args: list[str]) -> list[str]:
    """The agent's command line: its module and `args` (the flags every agent shares, then the user's)."""
    return [sys.executable, "-m", AGENTS[name], *args]


def _evaluate(url: str, n: int, out: Path, split: str, agent: str, agent_args: list[str]) -> dict[str, Any]:
    """The held-out evaluation, greedy. Of the user's agent flags only the task's shape carries over."""
    shape = [a for i, a in enumerate(agent_args) if a == "--operands" or (i and agent_args[i - 1] == "--operands")]
    subprocess.run(_agent(agent, ["--gateway", url, "--eval", str(n), "--split", split, "--out", str(out), *shape]),
                   check=True, capture_output=True, text=True)
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def _by_version(episodes: list[dict[str, float]]) -> dict[int, list[float]]:
    rewards: dict[int, list[float]] = {}
    for e in episodes:
        rewards.setdefault(int(e["version"]), []).append(e["reward"])
    return rewards


def _progress(episodes: list[dict[str, float]], policies: list[dict[str, Any]], elapsed: float,
              minutes: float) -> Table:
    table = Table(title=f"learning live: {elapsed / 60:.1f} of {minutes:.0f} min, {len(episodes)} episodes")
    for column in ("policy version", "episodes", "mean reward", "trained on", "step s", "published"):
        table.add_column(column, justify="right")
    trained = {p["version"]: p for p in policies}
    for version, rewards in sorted(_by_version(episodes).items())[-12:]:
        policy = trained.get(version, {})
        metrics = policy.get("metrics", {})
        table.add_row(str(version), str(len(rewards)), f"{sum(rewards) / len(rewards):.3f}",
                      str(metrics.get("samples", "")), f"{metrics.get('step_seconds', 0):.0f}" if metrics else "",
                      "yes" if policy.get("published_at") else ("base" if version == 0 else "failed"))
    return table


def _train(url: str, minutes: float, seed: int, log_path: Path, agent_name: str,
           agent_args: list[str]) -> list[dict[str, float]]:
    """Run the agent for `minutes` (or until `agent_args` ends it sooner), reading its episode log and the
    trainer's versions live."""
    agent = subprocess.Popen(_agent(agent_name, ["--gateway", url, "--minutes", str(minutes), "--seed", str(seed),
                                                 "--log", *agent_args]),
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    episodes: list[dict[str, float]] = []
    started = time.monotonic()
    policies: list[dict[str, Any]] = []
    last_poll = 0.0
    assert agent.stdout is not None
    with log_path.open("w") as log, Live(console=console, refresh_per_second=2) as live:
        for line in agent.stdout:
            if not line.startswith("{"):
                continue
            episodes.append(json.loads(line))
            log.write(line)
            if time.monotonic() - last_poll > 5:
                policies = httpx.get(f"{url}/v1/policies", timeout=10).json()["data"]
                last_poll = time.monotonic()
            live.update(_progress(episodes, policies, time.monotonic() - started, minutes))
    if agent.wait() != 0:
        raise SystemExit("the agent failed")
    return episodes


def _use_of_episodes(url: str, episodes: list[dict[str, Any]]) -> dict[str, Any]:
    """How much of what the agents generated the trainer learned from: episodes rewarded, sessions
    trained on (summed over every version's step figures; with `train.replay_successes`, the samples
    trained on again too), and sessions set aside by reason, as the store
    holds them (a version's figures count only what its own step set aside, not what was set aside after
    the last version); and where a step's time went, each part's mean over the versions (`first_call`:
    from a version's publish to the first call it served)."""
    listing = httpx.get(f"{url}/v1/policies", timeout=30).json()
    policies = listing["data"]
    set_aside = listing["sessions"]["set_aside"]
    trained = sum(p.get("metrics", {}).get("sessions", 0) for p in policies)
    replayed = [p["metrics"]["replayed"] for p in policies if "replayed" in p.get("metrics", {})]
    parts: dict[str, list[float]] = {}
    for policy in policies:
        for part, seconds in policy.get("metrics", {}).get("time_s", {}).items():
            parts.setdefault(part, []).append(seconds)
        if policy.get("first_call_at") and policy.get("published_at"):  # the last part: the version's first reply
            waited = datetime.fromisoformat(policy["first_call_at"]) - datetime.fromisoformat(policy["published_at"])
            parts.setdefault("first_call", []).append(waited.total_seconds())
    return {"rewarded_episodes": sum(1 for e in episodes if e.get("posted", True)), "trained_sessions": trained,
            "set_aside": set_aside, "trained_share": trained / len(episodes) if episodes else 0.0,
            "left_in_store": listing["sessions"],
            **({"replayed_samples": sum(replayed)} if replayed else {}),
            "step_time_s": {part: sum(values) / len(values) for part, values in parts.items()}}


def _plot(episodes: list[dict[str, float]], before: dict[str, Any], after: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    times = [e["t"] / 60 for e in episodes]
    window = 64
    rolling = [sum(e["reward"] for e in episodes[max(0, i - window + 1): i + 1]) / min(i + 1, window)
               for i in range(len(episodes))]
    left.plot(times, rolling, label=f"training reward (mean of last {window} episodes)")
    for i in range(1, len(episodes)):
        if episodes[i]["version"] != episodes[i - 1]["version"]:
            left.axvline(times[i], color="grey", alpha=0.2)
    left.set_xlabel("minutes (grey lines: a new policy version starts serving)")
    left.set_ylabel("reward")
    left.legend(loc="upper left")
    by_version = sorted(_by_version(episodes).items())
    right.plot([v for v, _ in by_version], [sum(r) / len(r) for _, r in by_version], marker="o",
               label="training reward per policy version")
    right.axhline(before["mean_reward"], color="tab:red", linestyle="--",
                  label=f"held-out eval before: {before['mean_reward']:.3f}")
    right.axhline(after["mean_reward"], color="tab:green", linestyle="--",
                  label=f"held-out eval after: {after['mean_reward']:.3f}")
    right.set_xlabel("policy version")
    right.set_ylabel("reward")
    right.legend(loc="upper left")
    fig.suptitle("tracetrain demo: SmolLM2-135M-Instruct learning arithmetic from its own traffic (2-core CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _operands(agent_args: list[str]) -> int:
    """`--operands N` among the tool agent's flags, or its default."""
    if "--operands" in agent_args and agent_args.index("--operands") + 1 < len(agent_args):
        return int(agent_args[agent_args.index("--operands") + 1])
    from tracetrain.demo.tool_agent import DEFAULT_OPERANDS

    return DEFAULT_OPERANDS


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tracetrain demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the agents train")
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--eval-split", choices=["test", "validation"], default="test",
                        help="the held-out set evaluated before and after: `validation` when choosing settings, so "
                             "the choice never sees the test sums")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--vllm-port", type=int, default=8100)
    parser.add_argument("--out", type=Path, default=Path("demo-out"))
    parser.add_argument("--engine", default="auto", choices=["auto", "vllm", "transformers"])
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the agents' training stream and the trainer (the held-out set is fixed)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any setting, as in `serve --set`: lr=1e-4 (or train.lr=1e-4), "
                             "gateway.admission=staleness")
    parser.add_argument("--agent-args", default="", metavar="ARGS",
                        help="more flags for the agent (python -m tracetrain.demo.arithmetic --help, or "
                             "tracetrain.demo.choices with --two-policies), e.g. "
                             "'--episodes 2000 --group-size 1 --no-group --reward-delay 30 300'")
    parser.add_argument("--agent", choices=sorted(AGENTS), default="arithmetic",
                        help="the agent: `arithmetic` (the OpenAI SDK, one turn per sum) or `tools` (a LangChain "
                             "agent adding numbers with a tool over several turns, rewarded at the end: "
                             "tracetrain.demo.tool_agent)")
    parser.add_argument("--two-policies", action="store_true",
                        help="two named policies on one base model, rewarded for opposite answers to the same "
                             "questions (tracetrain.demo.two_policies) instead of the arithmetic agent")
    args = parser.parse_args(argv)
    try:  # the agent speaks the OpenAI SDK; the trainer needs torch, peft and verl
        import matplotlib  # noqa: F401
        import openai  # noqa: F401
        import peft  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"tracetrain demo needs the demo extra ({exc.name} is missing): "
                         "pip install 'tracetrain[demo]'") from exc
    if args.agent == "tools":
        try:
            import langchain_openai  # noqa: F401
        except ImportError as exc:
            raise SystemExit("tracetrain demo --agent tools needs the langchain extra: "
                             "pip install 'tracetrain[demo,langchain]'") from exc
    from tracetrain.demo import arithmetic, choices, tool_agent

    args.out.mkdir(parents=True, exist_ok=True)
    overrides = parse_set(args.set)
    overrides["train"] = {"seed": args.seed, **overrides.get("train", {})}
    config = _write_config(args.out, args.port, args.vllm_port, args.engine, overrides, args.two_policies)
    url = f"http://127.0.0.1:{args.port}"
    log = args.out / "gateway.log"
    started = time.monotonic()
    console.rule("tracetrain demo")
    console.print(f"config {config}, logs {log}, seed {args.seed}")
    if args.two_policies:
        console.print(f"held-out split: {args.eval_size} of the {len(choices.TEST)} test pairs of {choices.__name__}; "
                      f"training draws from {len(choices.TRAIN)} other pairs, in either order")
    elif args.agent == "tools":
        count = _operands(shlex.split(args.agent_args))
        train, validation, test = tool_agent.SPLITS[count]
        pool = {"test": test, "validation": validation}[args.eval_split]
        console.print(f"held-out split: {args.eval_size} of the {len(pool)} {args.eval_split} sets of {count} numbers "
                      f"of {tool_agent.__name__}; training draws from {len(train)} other sets (split once by a fixed "
                      "seed on the unordered set: no held-out problem is asked in training, in any order)")
    else:
        sums = {"test": arithmetic.TEST, "validation": arithmetic.VALIDATION}[args.eval_split]
        console.print(f"held-out split: {args.eval_size} of the {len(sums)} {args.eval_split} sums of "
                      f"{arithmetic.__name__}; training draws from {len(arithmetic.TRAIN)} other pairs (split once by "
                      "a fixed seed on the unordered pair {a, b}: no held-out sum is asked in training, either way)")
    signal.signal(signal.SIGTERM, _exit_on_signal)  # so that `finally` stops the gateway and vLLM
    gateway = subprocess.Popen([sys.executable, "-m", "tracetrain.cli", "--config", str(config), "serve", "--train"],
                               stdout=log.open("wb"), stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    try:
        _wait_healthy(url, gateway, log)
        if args.two_policies:
            two_policies_demo.run(url, minutes=args.minutes, seed=args.seed, eval_size=args.eval_size, out=args.out,
                                  agent_args=shlex.split(args.agent_args))
            return
        console.print(f"[green]gateway + vLLM + trainer up[/green] after {time.monotonic() - started:.0f}s; "
                      f"held-out evaluation on {args.eval_size} sums (greedy)…")
        agent_args = shlex.split(args.agent_args)
        before = _evaluate(url, args.eval_size, args.out / "eval_before.json", args.eval_split, args.agent, agent_args)
        console.print(f"before training: mean reward {before['mean_reward']:.3f}, exact {before['exact']:.1%}")
        train_started = time.monotonic()
        episodes = _train(url, args.minutes, args.seed, args.out / "episodes.jsonl", args.agent, agent_args)
        train_minutes = (time.monotonic() - train_started) / 60
        after = _evaluate(url, args.eval_size, args.out / "eval_after.json", args.eval_split, args.agent, agent_args)
        versions = max(after["versions"])
        _plot(episodes, before, after, args.out / "reward.png")
        summary = Table(title="held-out evaluation (greedy, never trained on)")
        for column in ("", "policy version", "mean reward", "exact answers"):
            summary.add_column(column, justify="right")
        summary.add_row("before", str(before["versions"]), f"{before['mean_reward']:.3f}", f"{before['exact']:.1%}")
        summary.add_row("after", str(after["versions"]), f"{after['mean_reward']:.3f}", f"{after['exact']:.1%}")
        console.print(summary)
        total = (time.monotonic() - started) / 60
        console.print(f"{versions} policy versions in {train_minutes:.1f} min of training "
                      f"({versions / train_minutes:.1f} per minute); plot: {args.out / 'reward.png'}; "
                      f"total {total:.1f} min")
        (args.out / "summary.json").write_text(json.dumps({
            "seed": args.seed, "minutes": args.minutes, "eval_size": args.eval_size, "eval_split": args.eval_split,
            "agent": args.agent,
            "before": before,
            "after": after, "versions": versions, "train_minutes": train_minutes, "total_minutes": total,
            "episodes": len(episodes), "versions_per_minute": versions / train_minutes,
            "agent_args": args.agent_args, **_use_of_episodes(url, episodes)}, indent=1))
    finally:
        gateway.terminate()
        try:
            gateway.wait(timeout=60)
        except subprocess.TimeoutExpired:
            gateway.kill()
