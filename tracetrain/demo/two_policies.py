"""`tracetrain demo --two-policies`: two agents, two named policies, one base model, opposite rewards.

The gateway declares the policies `first` and `second` (each its own line of LoRA adapters, served side by
side by one vLLM and trained by one trainer). Two unmodified agents (`tracetrain.demo.choices`) ask the
same kind of question, "Which do you prefer, X or Y?", each bound to its policy by the `/p/{policy}` path:
the agent on `first` is rewarded for naming the option asked first, the one on `second` for the option
asked second. Held-out questions (pairs never asked in training) are answered greedily by each policy
before and after; each policy should come to name its own position and neither should drift toward the
other's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from tracetrain.engines.vllm_server import die_with_parent

AGENT = [sys.executable, "-m", "tracetrain.demo.choices"]
POLICIES = {"first": "first", "second": "second"}
"""Each named policy and the position its agent rewards."""
GATEWAY_POLICIES = [{"name": name} for name in POLICIES]
"""The config's `gateway.policies` for this demo."""
console = Console()


def evaluate(url: str, n: int, out: Path, stage: str) -> dict[str, dict[str, Any]]:
    """Every policy's held-out answers: the share naming the first option, the second, or neither."""
    results = {}
    for policy in POLICIES:
        path = out / f"eval_{stage}_{policy}.json"
        subprocess.run([*AGENT, "--gateway", url, "--policy", policy, "--eval", str(n), "--out", str(path)],
                       check=True, capture_output=True, text=True)
        results[policy] = json.loads(path.read_text())
    return results


def _versions(url: str) -> dict[str, int]:
    served = httpx.get(f"{url}/v1/policies", timeout=10).json().get("served_versions", {})
    return {policy: int(served.get(policy, 0)) for policy in POLICIES}


def _progress(episodes: list[dict[str, Any]], versions: dict[str, int], elapsed: float, minutes: float) -> Table:
    table = Table(title=f"two policies learning live: {elapsed / 60:.1f} of {minutes:.0f} min")
    for column in ("policy", "rewarded for", "serving version", "episodes", "reward, last 64 episodes"):
        table.add_column(column, justify="right")
    for policy, prefer in POLICIES.items():
        mine = [e["reward"] for e in episodes if e["policy"] == policy]
        recent = mine[-64:]
        table.add_row(policy, f"the {prefer} option", f"v{versions.get(policy, 0)}", str(len(mine)),
                      f"{sum(recent) / len(recent):.3f}" if recent else "")
    return table


def train(url: str, minutes: float, seed: int, log_path: Path, agent_args: list[str]) -> list[dict[str, Any]]:
    """Both agents for `minutes` (or until `agent_args` such as `--episodes N` ends them sooner), side by side,
    with a live table of each policy's version and reward."""
    agents = [subprocess.Popen([*AGENT, "--gateway", url, "--policy", policy, "--prefer", prefer, "--minutes",
                                str(minutes), "--seed", str(seed + i), "--log", *agent_args],
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               preexec_fn=die_with_parent)
              for i, (policy, prefer) in enumerate(POLICIES.items())]
    episodes: list[dict[str, Any]] = []
    lock = threading.Lock()

    def read(agent: subprocess.Popen[str]) -> None:
        assert agent.stdout is not None
        for line in agent.stdout:
            if line.startswith("{"):
                with lock:
                    episodes.append(json.loads(line))

    readers = [threading.Thread(target=read, args=(agent,), daemon=True) for agent in agents]
    for reader in readers:
        reader.start()
    started, versions = time.monotonic(), {policy: 0 for policy in POLICIES}
    with Live(console=console, refresh_per_second=1) as live:
        while any(reader.is_alive() for reader in readers):
            versions = _versions(url)
            with lock:
                live.update(_progress(list(episodes), versions, time.monotonic() - started, minutes))
            time.sleep(5)
    if any(agent.wait() != 0 for agent in agents):
        raise SystemExit("an agent failed")
    with log_path.open("w") as log:
        log.writelines(json.dumps(e) + "\n" for e in sorted(episodes, key=lambda e: e["t"]))
    return episodes


def summary_table(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="held-out questions (greedy, pairs never asked in training): share naming each option")
    for column in ("policy", "rewarded for", "", "first option", "second option", "neither", "versions"):
        table.add_column(column, justify="right")
    for policy, prefer in POLICIES.items():
        for stage, result in (("before", before[policy]), ("after", after[policy])):
            table.add_row(policy, prefer, stage, f"{result['first']:.1%}", f"{result['second']:.1%}",
                          f"{result['other']:.1%}", str(result["versions"]))
    return table


def plot(episodes: list[dict[str, Any]], before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    window = 64
    for policy in POLICIES:
        mine = [e for e in episodes if e["policy"] == policy]
        rolling = [sum(e["reward"] for e in mine[max(0, i - window + 1): i + 1]) / min(i + 1, window)
                   for i in range(len(mine))]
        left.plot([e["t"] / 60 for e in mine], rolling, label=f"{policy}: rewarded for the {POLICIES[policy]} option")
    left.set_xlabel("minutes")
    left.set_ylabel(f"training reward (mean of last {window} episodes)")
    left.legend(loc="lower right")
    labels, width = list(POLICIES), 0.2
    for i, (stage, results) in enumerate((("before", before), ("after", after))):
        for j, option in enumerate(("first", "second")):
            offset = (2 * i + j - 1.5) * width
            right.bar([k + offset for k in range(len(labels))], [results[p][option] for p in labels], width,
                      label=f"{stage}: names the {option} option", alpha=0.5 if stage == "before" else 1.0,
                      color="tab:blue" if option == "first" else "tab:orange")
    right.set_xticks(range(len(labels)), [f"policy {p}" for p in labels])
    right.set_ylabel("share of held-out answers (greedy)")
    right.legend(loc="upper center", fontsize="small")
    fig.suptitle("tracetrain demo --two-policies: one base model, two LoRA policies, opposite rewards (2-core CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(url: str, *, minutes: float, seed: int, eval_size: int, out: Path, agent_args: list[str]) -> dict[str, Any]:
    """Evaluate, train both policies side by side, evaluate again; write `summary.json` and `reward.png`."""
    console.print(f"held-out evaluation of both policies on {eval_size} questions (greedy)…")
    before = evaluate(url, eval_size, out, "before")
    started = time.monotonic()
    episodes = train(url, minutes, seed, out / "episodes.jsonl", agent_args)
    train_minutes = (time.monotonic() - started) / 60
    after = evaluate(url, eval_size, out, "after")
    console.print(summary_table(before, after))
    plot(episodes, before, after, out / "reward.png")
    summary = {"seed": seed, "minutes": minutes, "agent_args": agent_args, "train_minutes": train_minutes,
               "eval_size": eval_size,
               "episodes": {p: sum(e["policy"] == p for e in episodes) for p in POLICIES},
               "versions": _versions(url),
               "before": {p: {k: v for k, v in r.items() if k != "replies"} for p, r in before.items()},
               "after": {p: {k: v for k, v in r.items() if k != "replies"} for p, r in after.items()}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    console.print(f"versions {summary['versions']} in {train_minutes:.1f} min; plot: {out / 'reward.png'}")
    return summary
