"""`bench.learning_arms --keep`: seeds added one sitting at a time to one results file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.learning_arms import kept_runs


def _args(results_dir: Path, **overrides: object) -> argparse.Namespace:
    values = {"arms": ["grouped", "singletons"], "seeds": [1], "episodes": 512, "eval_size": 64,
              "results_dir": results_dir, "keep": True, "eval_split": "test"} | overrides
    return argparse.Namespace(**values)


def test_keep_takes_other_seeds_of_the_same_budget_and_leaves_what_runs_again(tmp_path: Path) -> None:
    def run(arm: str, seed: int, episodes: int = 512) -> dict[str, object]:
        return {"arm": arm, "seed": seed, "episode_budget": episodes, "eval_size": 64}

    held = [run("grouped", 0), run("singletons", 0), run("grouped", 1), run("grouped", 2, episodes=64),
            {"arm": "late", "seed": 0}]  # written before runs carried their budget: not comparable
    (tmp_path / "learning_arms.json").write_text(json.dumps({"raw": {"runs": held}}))
    assert kept_runs(_args(tmp_path)) == [run("grouped", 0), run("singletons", 0)]
    assert kept_runs(_args(tmp_path, keep=False)) == []
    assert kept_runs(_args(tmp_path / "none")) == []
