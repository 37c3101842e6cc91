"""bench/common.py's results writer: every maintained benchmark writes `<name>.md` and `<name>.json` through
it, and the JSON must say where and from what the figures came."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.common import (
    REPO_ROOT,
    Part,
    ResultTable,
    carried_part,
    parts_parser,
    provenance,
    read_parts,
    run_started,
    write_parts,
    write_results,
)


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


def test_results_name_no_directory_of_the_machine_they_ran_on(tmp_path: Path) -> None:
    raw = {"results_dir": REPO_ROOT / "bench" / "results", "root": str(REPO_ROOT),
           "cache": [f"{Path.home()}/.cache/model"], "elsewhere": "/srv/data"}
    md_path = write_results("demo", "A demo", "cmd", [], [], raw=raw, started=run_started(), results_dir=tmp_path)

    document = json.loads(md_path.with_suffix(".json").read_text())
    assert document["raw"] == {"results_dir": "bench/results", "root": ".", "cache": ["~/.cache/model"],
                               "elsewhere": "/srv/data"}


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


def _part(name: str, value: str) -> Part:
    table = ResultTable(f"{name} table", ["k", "v"])
    table.add("x", value)
    return Part(name, f"python -m bench.demo --parts {name}", provenance(run_started()), [table], [f"{name} note"],
                {"value": value})


def test_running_one_part_keeps_the_others_results(tmp_path: Path) -> None:
    """A benchmark in parts: `--parts b` rewrites b's section and re-renders a's from the JSON, each with its
    own provenance, in the benchmark's order whatever order they ran in."""
    titles = {"a": "first part", "b": "second part"}
    write_parts("demo", "Demo", titles, [_part("a", "1"), _part("b", "2")], started=run_started(),
                results_dir=tmp_path)
    first = read_parts("demo", tmp_path)
    md_path = write_parts("demo", "Demo", titles, [_part("b", "3")], started=run_started(), results_dir=tmp_path)

    parts = read_parts("demo", tmp_path)
    assert parts["a"].raw == {"value": "1"} and parts["a"].provenance == first["a"].provenance
    assert parts["b"].raw == {"value": "3"} and parts["b"].tables[0].rows == [["x", "3"]]
    document = json.loads(md_path.with_suffix(".json").read_text())
    assert document["command"] == "python -m bench.demo --parts b" and document["notes"] == ["b note"]
    assert {"git_sha", "started_utc", "ended_utc"} <= set(document["provenance"])
    markdown = md_path.read_text()
    assert markdown.index("## Part `a`: first part") < markdown.index("## Part `b`: second part")
    assert "| x | 1 |" in markdown and "| x | 3 |" in markdown and "| x | 2 |" not in markdown
    assert f"`a`: {first['a'].provenance['started_utc']}" in markdown


def test_parts_flag_keeps_the_benchmarks_order_and_refuses_unknown_parts() -> None:
    parser = parts_parser("bench.example", "An example.", {"a": "first", "b": "second"})
    assert parser.parse_args([]).parts == ["a", "b"]
    assert parser.parse_args(["--parts", "b,a"]).parts == ["a", "b"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--parts", "c"])


def test_carried_parts_keep_their_earlier_provenance(tmp_path: Path) -> None:
    """Folding a benchmark into another carries its last results over unrun: a JSON whole, a lone .md (from
    before results had JSON) as text under its machine line."""
    old = tmp_path / "old"
    table = ResultTable("calls", ["arm", "calls/s"])
    table.add("a", "12")
    write_results("json_one", "Old", "python -m bench.json_one --long", [table], ["old note"], raw={"n": 1},
                  started=run_started(), results_dir=old)
    (old / "md_one.md").write_text("# Md one\n\n`python -m bench.md_one --rounds 3`\n\nvm · 2 CPUs · 2026-11-26 "
                                   "03:51 UTC\n\n### Table\n\n| a |\n| ---: |\n| 1 |\n\n- a note\n")
    from_json, from_md = carried_part("long", old / "json_one.json"), carried_part("short", old / "md_one.md")
    assert from_json.command == "python -m bench.json_one --long" and from_json.raw == {"n": 1}
    assert from_json.provenance["started_utc"] and "json_one.json" in from_json.provenance["note"]
    assert from_md.command == "python -m bench.md_one --rounds 3" and from_md.body is not None
    assert from_md.body.startswith("#### Table") and from_md.body.endswith("- a note")

    md_path = write_parts("both", "Both", {"long": "L", "short": "S"}, [from_json, from_md], started=run_started(),
                          results_dir=tmp_path)
    markdown = md_path.read_text()
    assert "vm · 2 CPUs · 2026-11-26 03:51 UTC" in markdown and "Carried over unrun" in markdown
    assert read_parts("both", tmp_path)["short"].body == from_md.body
