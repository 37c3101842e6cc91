"""How a policy's sampling sharpened while it trained, read from a run's store: per window of versions,
how many different completions a group of attempts held, how sure the sampled tokens were, and how
many groups had nothing to teach (every reward equal).

A policy that collapses onto a few answers shows all three at once: distinct completions per group
fall, the sampled tokens' mean logprob climbs towards 0, and all-equal groups (which a group baseline
cannot learn from) take over the traffic. `bench.learning_speed` records this for every tracetrain run;
run it by hand on any store:

    python -m bench.sharpening bench/out/learning_speed/learning_speed/tracetrain-vllm-s0-lr0.0002/store.db
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import ResultTable, console
from tracetrain.store.db import connect_db
from tracetrain.store.export import iter_rows


@dataclass
class Window:
    """The rewarded groups whose attempts were sampled by versions `first`..`last`."""

    first: int
    last: int
    groups: int
    distinct: float
    """Mean number of different completion texts per group."""
    logprob: float
    """Mean logprob of a sampled token under the policy that sampled it."""
    all_equal: float
    """Share of groups (of two or more attempts) whose rewards were all equal."""
    reward: float
    """Mean reward of an attempt."""


def windows(rows: Iterable[dict[str, Any]], width: int = 5) -> list[Window]:
    """Export rows (`tracetrain.store.export`) in windows of `width` versions, by the version that
    sampled each session's first answer token; sessions never rewarded (held-out evaluations) are left out."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["final"] and row["segment"] == 0 and any(row["loss_mask"]):
            groups[row["group_id"]].append(row)
    by_window: dict[int, list[list[dict[str, Any]]]] = defaultdict(list)
    for members in groups.values():
        version = min(_sampled_version(r) for r in members)
        by_window[version // width].append(members)
    result = []
    for k in sorted(by_window):
        members_of = by_window[k]
        logprobs = [lp for g in members_of for r in g for lp, m in zip(r["logprobs"], r["loss_mask"], strict=True) if m]
        multi = [g for g in members_of if len(g) > 1]
        result.append(Window(
            first=k * width, last=k * width + width - 1, groups=len(members_of),
            distinct=statistics.fmean(len({_text(r) for r in g}) for g in members_of),
            logprob=statistics.fmean(logprobs),
            all_equal=sum(len({r["reward"] for r in g}) == 1 for g in multi) / len(multi) if multi else 0.0,
            reward=statistics.fmean(r["reward"] for g in members_of for r in g)))
    return result


def _sampled_version(row: dict[str, Any]) -> int:
    return int(next(v for v, m in zip(row["policy_versions"], row["loss_mask"], strict=True) if m))


def _text(row: dict[str, Any]) -> str:
    return str((row["completion"][-1] or {}).get("content") or "").strip()


def of_store(store: Path, width: int = 5) -> list[dict[str, Any]]:
    """`windows` of a run's SQLite store, as plain dicts (what `ArmRun.sharpening` holds)."""
    return [asdict(w) for w in windows(iter_rows(connect_db(f"sqlite:///{store}")), width)]


def table(title: str, rows: list[dict[str, Any]]) -> ResultTable:
    out = ResultTable(title, ["versions", "groups", "distinct completions per group", "sampled-token logprob",
                              "all-equal groups", "mean reward"])
    for w in rows:
        out.add(f"{w['first']}-{w['last']}", w["groups"], f"{w['distinct']:.1f}", f"{w['logprob']:.2f}",
                f"{w['all_equal']:.0%}", f"{w['reward']:.3f}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sharpening", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stores", nargs="+", type=Path, help="SQLite store files (store.db of a run)")
    parser.add_argument("--width", type=int, default=5, help="versions per window")
    args = parser.parse_args(argv)
    for store in args.stores:
        console.print(table(str(store), of_store(store, args.width)).rich())


if __name__ == "__main__":
    main()
