"""Carrying vLLM to the GPU machine for part 3 of the GPU check, in several device calls.

The device image has torch 2.11 (CUDA 13) but no vLLM, and no network. vLLM 0.26.0 is the last release
built for that torch; its wheel is about 290 MiB, over one call's 64 MiB carry. So:

1. vLLM's wheel is slimmed: VLLM_DROPPED are kernels that a dense Llama in bf16 on a Hopper GPU never
   loads (FlashAttention 2, which Hopper does not use when FlashAttention 3 is there; the MoE kernels,
   which vLLM imports inside a suppress(ImportError); DeepGEMM and the Blackwell attention sources; the
   Rust front end, an optional binary). What stays is about 100 MiB.
2. Its Python dependencies that the image lacks (VLLM_CARRIED) and the wheels parts 1-2 carry
   (`gpu_check.CARRIED`) join it in one tar, cut into chunks that each fit one call beside the tree.
3. Each call but the last copies its chunk to the machine's /tmp (a carried folder does not survive
   the next call, /tmp does while the machine stays warm: 30 s); the last joins, checks, installs and
   runs part 3. One more call runs the GPU tests of vLLM on what is installed.

The dependency list was found by importing vLLM's server, engine core, GPU worker, LoRA and sampler
modules in a clean environment holding only the image's packages, adding what was missing until
nothing was. `VLLM_USE_FLASHINFER_SAMPLER=0` keeps vLLM from importing FlashInfer (not carried).

    python -m bench.gpu_carry --out .gpu-carry      # here: the chunk folders and the device commands
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from bench.common import git_sha

VLLM = "vllm==0.26.0"
VLLM_DROPPED = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so", "vllm/vllm-rs",
                "vllm/third_party/deep_gemm/", "vllm/third_party/fmha_sm100/")
VLLM_CARRIED = (
    # the OpenAI/Anthropic server and its protocol types
    "fastapi==0.136.1", "starlette==1.10.0", "uvicorn==0.54.0", "python-multipart", "httptools", "websockets",
    "openai==3.57.0", "anthropic==2.14.0", "jiter==0.19.0", "distro==1.9.0", "sniffio==1.3.1",
    "docstring-parser==0.18.0", "httpx2", "httpcore2", "prometheus-fastapi-instrumentator==8.1.0",
    "model-hosting-container-standards==0.1.16", "jmespath", "openai-harmony==0.0.8", "partial-json-parser",
    # structured output, tokenizers, quantization configs
    "lm-format-enforcer==0.11.3", "interegular==0.3.3", "llguidance==1.7.3", "outlines_core==0.2.14",
    "lark==1.2.2", "xgrammar==0.2.8", "apache-tvm-ffi==0.1.15.post2", "mistral_common==1.13.1", "pycountry",
    "pydantic-extra-types", "compressed-tensors==0.17.0",
    # the engine's processes and compilation
    "pyzmq==27.3.0", "msgspec==0.22.0", "blake3==1.0.11", "pybase64==1.5.1", "cbor2==6.3.0", "ijson==3.6.0",
    "setproctitle==1.3.8", "watchfiles==1.3.0", "python-json-logger==4.2.0", "cachetools", "depyf==0.20.0",
    "astor==0.8.1", "dill==0.4.1",
    # the gateway's own, beyond parts 1-2's
    "alembic", "mako",
)
"""xgrammar 0.2.8 with tvm-ffi 0.1.15 rather than vLLM's pin (0.1.10): xgrammar's wheel for that pin is
43 MiB, 0.2.8's is 1 MiB, and nothing carried needs 0.1.10 (FlashInfer, which does, is not carried)."""
CHUNK_BYTES = 56 * 2**20
"""Per call, beside the tree (about 4 MiB): under the 64 MiB carry."""
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64",
                                                                                    "manylinux1_x86_64"]
PIP_DOWNLOAD = ("python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
                + " ".join(f"--platform {platform}" for platform in PLATFORMS))
"""Wheels for the device image's CPython 3.12 on x86-64 Linux (pip matches each manylinux tag exactly)."""


def download(specs: list[str], target: Path) -> None:
    subprocess.run([sys.executable, "-m", *PIP_DOWNLOAD.split()[2:], "-q", "-d", str(target), *specs], check=True)


def slim_vllm(wheel: Path) -> Path:
    """Rewrite vLLM's wheel without VLLM_DROPPED, in place."""
    return drop_from_wheel(wheel, VLLM_DROPPED)


def drop_from_wheel(wheel: Path, dropped: tuple[str, ...]) -> Path:
    """Rewrite `wheel` without the files whose paths start with one of `dropped` (and their RECORD lines),
    in place: pip installs what RECORD lists, and no longer finds the dropped files there."""
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            if item.filename.startswith(dropped):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if line and not line.startswith(dropped)]
                data = ("\n".join(kept) + "\n").encode()
            target.writestr(item, data)
    slim.replace(wheel)
    return wheel


def build(out: Path, parts_wheels: Path) -> list[Path]:
    """The chunk folders `out/1`, `out/2`, … holding the tar of every wheel part 3 needs, cut to size."""
    with tempfile.TemporaryDirectory() as tmp:
        wheels = Path(tmp) / "wheels"
        download([VLLM], wheels)
        slim_vllm(next(wheels.glob("vllm-*.whl")))
        download(list(VLLM_CARRIED), wheels)
        for wheel in parts_wheels.glob("*.whl"):
            (wheels / wheel.name).write_bytes(wheel.read_bytes())
        bundle = Path(tmp) / "bundle.tar"
        with tarfile.open(bundle, "w") as tar:
            for wheel in sorted(wheels.glob("*.whl")):
                tar.add(wheel, arcname=wheel.name)
        return write_chunks(bundle.read_bytes(), out)


def write_chunks(data: bytes, out: Path, chunk_bytes: int = CHUNK_BYTES) -> list[Path]:
    """`data` cut into `out/1/chunk.01`, `out/2/chunk.02`, … (one folder per device call; the names sort in
    order for `cat`), and its SHA-256 in `out/bundle.sha256`."""
    folders = []
    for index, start in enumerate(range(0, len(data), chunk_bytes), start=1):
        folder = out / str(index)
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("chunk.*"):
            old.unlink()
        (folder / f"chunk.{index:02d}").write_bytes(data[start:start + chunk_bytes])
        folders.append(folder)
    (out / "bundle.sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    return folders


def device_calls(out: Path, folders: list[Path], part3_command: str) -> list[dict[str, object]]:
    """The device tool's calls, in order: each chunk to /tmp; join, check, install and run part 3; the GPU tests
    of vLLM (tests/gpu/test_gpu_vllm.py)."""
    digest = (out / "bundle.sha256").read_text().strip()
    calls: list[dict[str, object]] = [{"carry": [str(f)], "timeout_s": 60, "command": f"cp {f}/chunk.* /tmp/"}
                                      for f in folders[:-1]]
    install = (f"cat /tmp/chunk.* {folders[-1]}/chunk.* > /tmp/b.tar && echo '{digest}  /tmp/b.tar' | sha256sum -c "
               "&& mkdir -p /tmp/wh && tar -xf /tmp/b.tar -C /tmp/wh && rm /tmp/b.tar /tmp/chunk.* && python3 -m pip "
               "install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/wh/*.whl "
               "|| exit 1")
    environment = "export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1"
    calls.append({"carry": [str(folders[-1])], "timeout_s": 595,
                  "command": f"set -o pipefail; {install}; {environment}; {part3_command}"})
    # vLLM stays installed in /tmp/site while the machine is warm: the GPU tests of vLLM in a call of their own.
    calls.append({"carry": [], "timeout_s": 300,
                  "command": f"set -o pipefail; {environment}; timeout 280 python3 -m pytest --noconftest -p "
                             "no:cacheprovider -q -s -m gpu tests/gpu/test_gpu_vllm.py 2>&1 | tee "
                             '"$OUT/gpu_tests.log"'})
    return calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".gpu-carry"), help="the chunk folders (git-ignored)")
    parser.add_argument("--parts-wheels", type=Path, default=Path(".whl"),
                        help="parts 1-2's wheels (python -m bench.gpu_check --wheels .whl)")
    args = parser.parse_args(argv)
    if not any(args.parts_wheels.glob("*.whl")):
        raise SystemExit(f"no wheels in {args.parts_wheels}: first python -m bench.gpu_check --wheels .whl")
    folders = build(args.out, args.parts_wheels)
    part3 = (f'python3 -m bench.gpu_check --part 3 --out "$OUT" --git-sha {git_sha()} '
             '2>&1 | tee "$OUT/gpu_check_part3.log"')
    for number, call in enumerate(device_calls(args.out, folders, part3), start=1):
        print(f"# device call {number}: carry {call['carry']}, timeout_s {call['timeout_s']}\n{call['command']}\n")


if __name__ == "__main__":
    main()
