"""Carrying vLLM to the GPU machine in chunks (bench/gpu_carry.py): the slimmed wheel and the chunks.

The download itself needs PyPI and 300 MB, so these tests build a small wheel of their own."""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from bench.gpu_carry import VLLM_DROPPED, device_calls, slim_vllm, write_chunks


def test_the_slim_wheel_drops_the_unused_kernels_and_their_record_lines(tmp_path: Path) -> None:
    wheel = tmp_path / "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    kept = ["vllm/__init__.py", "vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
            "vllm/third_party/pynvml.py"]
    dropped = ["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/third_party/deep_gemm/x.py", "vllm/vllm-rs"]
    record = "".join(f"{name},sha256=x,1\n" for name in kept + dropped)
    with zipfile.ZipFile(wheel, "w") as z:
        for name in kept + dropped:
            z.writestr(name, b"x")
        z.writestr("vllm-0.26.0.dist-info/RECORD", record)
    slim_vllm(wheel)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        lines = z.read("vllm-0.26.0.dist-info/RECORD").decode().splitlines()
    assert set(kept) <= names and not names & set(dropped)
    assert all(line and not line.startswith(VLLM_DROPPED) for line in lines) and len(lines) == len(kept)


def test_the_chunks_join_back_into_the_bundle_and_the_last_call_checks_it(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(2_500)
    monkeypatch.chdir(tmp_path)  # carried paths are relative to the repository root, as the device tool takes them
    folders = write_chunks(data, Path("carry"), chunk_bytes=1_000)
    assert [f.name for f in folders] == ["1", "2", "3"]
    calls = device_calls(Path("carry"), folders, "echo part 3")
    assert [c["carry"] for c in calls] == [["carry/1"], ["carry/2"], ["carry/3"], []]
    assert "tests/gpu/test_gpu_vllm.py" in str(calls[-1]["command"])
    calls = calls[:-1]
    # What the device machine does, run here with its /tmp in a folder of the test's own.
    machine = tmp_path / "machine"
    machine.mkdir()
    for call in calls[:-1]:
        subprocess.run(str(call["command"]).replace("/tmp/", f"{machine}/"), shell=True, check=True)
    joined = subprocess.run(f"cat {machine}/chunk.* {folders[-1]}/chunk.* | sha256sum", shell=True, check=True,
                            capture_output=True, text=True).stdout.split()[0]
    assert joined == hashlib.sha256(data).hexdigest() == Path("carry/bundle.sha256").read_text().strip()
    assert "sha256sum -c" in str(calls[-1]["command"]) and "echo part 3" in str(calls[-1]["command"])
