"""bench/common.py's results writer: every maintained benchmark writes `<name>.md` and `<name>.json` through
it, and the JSON must say where and from what the figures came."""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import ResultTable, run_started, write_results


def test_write_results_puts_tables_raw_and_provenance_side_by_side(tmp_path: Path) -> None:
    table = ResultTable("calls", ["arm", "calls/s"])
    table.add("a | b", "12.5")
    started = run_started()
    md_path = write_results("demo", "A demo", "python -m bench.demo --fast", [table], ["a note"],
                            raw={"rate": float("nan"), "runs": [1, 2]}, started=started, results_dir=tmp_path)

    document = json.loads(md_path.with_suffix(".json").read_text())
    assert document["benchmark"] == "demo" and document["command"] == "python -m bench.demo --fast"
    assert document["tables"] == [{"title": "calls", "columns": ["arm", "calls/s"], "rows": [["a | b", "12.5"]]}]
    assert document["raw"] == {"rate": None, "runs": [1, 2]}, "NaN is not JSON: it is written as null"
    info = document["provenance"]
    for key in ("git_sha", "cpu_model", "cpu_count", "gpus", "versions", "load_average", "started_utc", "ended_utc"):
        assert key in info, key
    assert {"torch", "transformers", "vllm", "tracetrain"} <= set(info["versions"])
    assert info["started_utc"] <= info["ended_utc"] and len(info["load_average"]) == 3

    markdown = md_path.read_text()
    assert markdown.startswith("# A demo\n") and "| a \\| b | 12.5 |" in markdown
    assert f"git {info['git_sha'][:12]}" in markdown and "- a note" in markdown and "`demo.json`" in markdown


def test_write_results_keeps_provenance_recorded_elsewhere(tmp_path: Path) -> None:
    """A device machine's run is summarised here: its own provenance goes in, not this machine's."""
    device = {"git_sha": "0123abc", "gpus": [{"name": "NVIDIA H100", "driver": "580.1"}], "versions": {}}
    md_path = write_results("device", "Device", "cmd", [], [], raw={}, started=run_started(), results_dir=tmp_path,
                            body="custom body", info=device)
    assert json.loads(md_path.with_suffix(".json").read_text())["provenance"] == device
    markdown = md_path.read_text()
    assert "custom body" in markdown and "NVIDIA H100 (driver 580.1)" in markdown and "git 0123abc" in markdown


def test_gateway_workers_compares_each_store_with_its_own_single_process(tmp_path: Path) -> None:
    """The table `bench.gateway_workers` rewrites after every repeat, from measured rows (no servers here)."""
    import argparse

    from bench.gateway_workers import write_table

    def row(rps: float) -> dict[str, float]:
        return {"rps": rps, "p50": 10.0, "p99": 20.0, "cpu": 1.0, "errors": 0, "missing": 0}

    results = {("sqlite", 1, "tree"): [row(100.0)], ("sqlite", 2, "tree"): [row(150.0)],
               ("postgresql", 1, "tree"): [row(50.0)], ("postgresql", 2, "tree"): [row(75.0)]}
    args = argparse.Namespace(stream=False, concurrency=64, requests=10, warmup=1, upstream_workers=1, repeats=1,
                              baseline_src=None, results_dir=tmp_path, workers="1,2", stores="sqlite,postgresql")
    md_path = write_table(args, ["--repeats", "1"], results, run_started(), skipped_postgresql=False)

    rows = json.loads(md_path.with_suffix(".json").read_text())["tables"][0]["rows"]
    assert [(r[0], r[1], r[4]) for r in rows] == [("sqlite", "1", "1.00x"), ("sqlite", "2", "1.50x"),
                                                  ("postgresql", "1", "1.00x"), ("postgresql", "2", "1.50x")]
    assert md_path.read_text().startswith("# Gateway processes on the fixed upstream")
