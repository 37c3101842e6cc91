"""bench/gpu_check.py's dry run on this CPU: every part at tiny sizes, in the files and format a GPU run
returns, with the device commands and the wheel list printed; then `--collect` on its output.

The dry run is the only place the GPU check's code runs before a GPU lease, so it also checks that the
device side of part 2 agrees with the CPU (here both sides are the CPU): one FSDP2 step with world size
1 over gloo equals one local step, and a LoRA adapter equals its merge.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.setup_steps import TORCH_MISSING

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    pytest.importorskip("torch", reason=TORCH_MISSING)
    out = tmp_path_factory.mktemp("gpu_check")
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out), "--work-dir",
                           str(out / "work"), "--git-sha", "0123abc"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout


def _part(out: Path, number: int) -> dict[str, Any]:
    return json.loads((out / f"gpu_check_part{number}.json").read_text())  # type: ignore[no-any-return]


def test_every_part_writes_its_record_with_provenance(dry_run: tuple[Path, str]) -> None:
    from bench.gpu_check import PROVENANCE_KEYS, SCHEMA

    out, _ = dry_run
    for number in (1, 2, 3):
        part = _part(out, number)
        assert part["schema"] == SCHEMA and part["part"] == number and part["dry_run"] is True
        assert set(PROVENANCE_KEYS) <= set(part["provenance"]), number
        info = part["provenance"]
        assert info["git_sha"] == "0123abc"
        assert {"torch", "transformers", "peft", "vllm"} <= set(info["versions"])
        assert info["started_utc"] <= info["ended_utc"] and len(info["load_average"]) == 3
        assert "--part" in part["device_command"] and "pip install" in part["device_command"]
    markdown = (out / "gpu_check.md").read_text()
    assert all(f"## Part {n}:" in markdown for n in (1, 2, 3))
    assert "| run | model | params | mode |" in markdown


def test_part_1_times_the_real_step_and_counts_its_flops(dry_run: tuple[Path, str]) -> None:
    out, _ = dry_run
    part = _part(out, 1)
    assert part["status"] == "ok" and {r["mode"] for r in part["results"]} == {"full", "lora"}
    for run in part["results"]:
        assert run["timed_steps"] == 2 and run["warmup_steps"] == 1 and run["tokens_per_s"] > 0
        assert run["model_flops_per_step"]["total"] > run["model_flops_per_step"]["dense"] > 0
        assert run["mfu"] is None, "no GPU peak on the CPU"
        counts = run["params"]
        assert counts["body"] + counts["embedding"] + counts["untied_head"] == counts["total"]
        assert (counts["lora"] > 0) == (run["mode"] == "lora")


def test_part_2_finds_fsdp_and_local_and_lora_and_merge_equal(dry_run: tuple[Path, str]) -> None:
    """The tolerances of tests/integration/test_fsdp.py (weights within lr × 1e-2 after one step at lr 1e-3)
    and of tests/gpu (adapter against merge within 1e-3 nats)."""
    out, _ = dry_run
    results = {r["name"]: r for r in _part(out, 2)["results"]}
    assert {r["status"] for r in results.values()} == {"ok"}, results
    for lora in ("full", "lora"):
        fsdp = results[f"fsdp2 (world 1) vs local, {lora} float32, tiny"]
        assert fsdp["max_abs_weight_moved"] > 0.5e-3 and fsdp["max_abs_weight_difference"] < 1e-5
    merge = results["lora adapter vs merged, float32, tiny"]
    assert merge["max_abs_adapter_vs_merged"] < 1e-3 < merge["max_abs_adapter_vs_base"]
    precision = results["logprobs bf16 vs float32, tiny init"]
    assert precision["positions"] > 0 and precision["fp32_vs_cpu_fp32"]["max"] == 0.0


def test_part_3_says_why_it_did_not_run(dry_run: tuple[Path, str]) -> None:
    """This environment has no vLLM (it lives in .venv-vllm): part 3 is skipped, with the reason."""
    part = _part(dry_run[0], 3)
    assert part["status"] == "skipped" and "vllm" in part["results"][0]["reason"].lower()
    assert any("bench/gpu_carry.py" in note for note in part["notes"])


def test_the_plan_prints_the_device_commands_and_the_wheels(dry_run: tuple[Path, str]) -> None:
    out, stdout = dry_run
    plan = json.loads((out / "gpu_check_plan.json").read_text())
    assert "python3 -m bench.gpu_check --part 1,2 --out \"$OUT\" --git-sha 0123abc" in stdout
    assert "pytest --noconftest" in stdout and "python -m bench.gpu_check --wheels .whl" in stdout
    assert all(len(entry["command"]) <= 2000 for entry in plan["commands"])
    assert all(entry["carry"] == [".whl"] for entry in plan["commands"] if "part 3" not in entry["what"])
    wheels = plan["wheels"]
    assert {"verl", "ray", "pydantic", "sqlmodel", "tensordict"} <= set(wheels["carried"])
    assert all(version for version in wheels["carried"].values())
    # an import the trainer gained that is neither on the device image nor carried would fail there
    assert wheels["unaccounted"] == []
    assert "pip download --no-deps --only-binary=:all: --python-version 3.12" in stdout


def test_collect_summarises_the_returned_files(dry_run: tuple[Path, str], tmp_path: Path) -> None:
    out, _ = dry_run
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--collect", str(out), "--results-dir",
                           str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert "gpu_check.md" in done.stdout
    combined = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [p["part"] for p in combined["raw"]["parts"]] == [1, 2, 3]
    # bench.common's writer, with the device run's provenance rather than the collecting machine's
    assert combined["provenance"]["git_sha"] == "0123abc"
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "## Part 2:" in markdown and "git 0123abc" in markdown


def test_a_later_collection_replaces_the_parts_it_brings_and_keeps_the_rest(dry_run: tuple[Path, str],
                                                                            tmp_path: Path) -> None:
    """A device call that re-measures part 3 and runs the GPU tests must not drop parts 1 and 2 from the
    results file; the tests' closing line and printed figures become a note."""
    from bench.gpu_check import collect

    out, _ = dry_run
    results = tmp_path / "results"
    collect([out], results)
    later = tmp_path / "later"
    later.mkdir()
    part3 = {**_part(out, 3), "status": "ok"}
    part3["provenance"] = {**part3["provenance"], "started_utc": "2099-01-01T00:00:00Z",
                           "ended_utc": "2099-01-01T00:05:00Z"}
    (later / "gpu_check_part3.json").write_text(json.dumps(part3))
    tests_only = tmp_path / "tests-only"
    tests_only.mkdir()
    (tests_only / "gpu_tests.log").write_text(
        "healthy after 63s; 184 calls in 41s, 0 failed; 16 versions served (23.6/min)\n.\n"
        "FAILED tests/gpu/test_gpu_vllm.py::test_x - boom\n"
        "==== 1 failed, 1 passed in 229.37s ====\n")
    collect([later, tests_only], results)
    combined = json.loads((results / "gpu_check.json").read_text())
    parts = combined["raw"]["parts"]
    assert [p["part"] for p in parts] == [1, 2, 3]
    assert parts[2]["provenance"]["started_utc"] == "2099-01-01T00:00:00Z"
    note = next(n for n in combined["notes"] if n.startswith("GPU tests in the device call of"))
    assert "(log written)" in note and "1 failed, 1 passed in 229.37s" in note
    assert "failed: tests/gpu/test_gpu_vllm.py::test_x" in note and "figures: healthy after 63s; 184 calls" in note
    # a third collection keeps that note with the parts it keeps
    collect([later], results)
    assert any("figures: healthy after 63s" in n for n in json.loads((results / "gpu_check.json").read_text())["notes"])


def test_the_flop_count_follows_the_stated_formula() -> None:
    from bench.gpu_check import ModelSpec, step_flops
    from tracetrain.trainer.data import Sample

    spec = ModelSpec("t", hidden=8, layers=2, heads=2, kv_heads=1, intermediate=16, vocab=10, about="")
    samples = [Sample("a", "a", [1] * 6, [0, 0, 0, 1, 1, 1], [0.0] * 6, [0] * 6, 0.0),
               Sample("b", "b", [1] * 4, [0, 0, 1, 1], [0.0] * 4, [0] * 4, 0.0)]
    counts = {"total": 1000, "body": 900, "lora": 0}
    full = step_flops(spec, counts, samples, lora=False)
    assert full["tokens"] == 10 and full["logit_rows"] == 5
    assert full["dense"] == 6 * 900 * 10 and full["head"] == 6 * 10 * 8 * 5
    assert full["attention"] == 6 * 2 * 8 * (36 + 16) and full["six_nd"] == 6 * 1000 * 10
    lora = step_flops(spec, {**counts, "lora": 50}, samples, lora=True)
    assert lora["dense"] == 4 * 900 * 10 and lora["head"] == 4 * 10 * 8 * 5 and lora["adapters"] == 6 * 50 * 10
    assert lora["total"] == lora["dense"] + lora["head"] + lora["adapters"] + lora["attention"]


@pytest.mark.parametrize(("name", "tflops"), [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.5),
                                              ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.5),
                                              ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0)])
def test_the_peak_comes_from_the_device_name(name: str, tflops: float) -> None:
    from bench.gpu_check import peak_for

    peak = peak_for(name)
    assert peak is not None and peak.tflops == tflops and "datasheet" in peak.source
    assert peak_for("Tesla T4") is None
