"""tracetrain installed the way users install it: from a built wheel, without the source tree on the path.

Every other test imports the editable checkout, where files the package reads at run time (the bundled
chat template) are found next to the sources whether or not the wheel carries them. Here the wheel is
built, installed into a fresh virtual environment, and the installed `tracetrain` entry point serves a
chat completion and answers `demo --help` and `export --help`.

The fresh environment reuses this environment's dependencies (torch, transformers, ...) through a `.pth`
file naming its site-packages, so nothing is downloaded or installed twice. That is safe: `site` adds
a directory named in a `.pth` file to `sys.path` but does not process the `.pth` files inside it, so
the checkout's editable finder (`__editable__.tracetrain-*.pth` in that site-packages) stays inactive.
`test_installed_package_is_the_wheel` checks this rather than trusting it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.servers import free_port
from tests.support.setup_steps import SETUPTOOLS_MISSING

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO_ROOT / "tracetrain"


def _runtime_data_files() -> list[str]:
    """Every non-Python file in the package, as a wheel path (`tracetrain/proxy/templates/...`).

    Anything in the package that is not code is there to be read at run time, so all of it must be in
    the wheel: a new data file added without a package-data entry in pyproject.toml fails here.
    """
    return sorted(
        path.relative_to(REPO_ROOT).as_posix()
        for path in PACKAGE_DIR.rglob("*")
        if path.is_file() and path.suffix not in {".py", ".pyc"} and "__pycache__" not in path.parts
    )


@dataclass
class FreshVenv:
    root: Path
    bin: Path
    site_packages: Path
    cwd: Path
    """A directory outside the checkout to run from, so that neither `''` nor the cwd on `sys.path`
    can pick up the source tree."""
    env: dict[str, str]

    @property
    def python(self) -> Path:
        return self.bin / "python"

    @property
    def tracetrain(self) -> Path:
        return self.bin / "tracetrain"

    def run(self, *args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(a) for a in args], cwd=self.cwd, env=self.env, capture_output=True,
                              text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from this checkout, as `pip wheel` builds it for users.

    Built from a copy of the checkout: building in place makes setuptools write `build/` (not ignored
    by git) and rewrite `tracetrain.egg-info` inside the working tree that others are using.
    `--no-build-isolation`: the build backend comes from this environment (the dev extra pins it), so
    the test needs no package index and takes seconds.
    """
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip(SETUPTOOLS_MISSING)
    source = tmp_path_factory.mktemp("source")
    for item in REPO_ROOT.iterdir():  # pyproject.toml, README.md (the long description), and any other top-level file
        if item.is_file():
            shutil.copy2(item, source / item.name)
    shutil.copytree(PACKAGE_DIR, source / "tracetrain", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
         str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, f"pip wheel failed:\n{build.stdout}\n{build.stderr}"
    wheels = list(dist.glob("tracetrain-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> FreshVenv:
    """A new virtual environment with only the wheel installed in it, borrowing dependencies from this one."""
    root = tmp_path_factory.mktemp("venv")
    # --without-pip: pip, like every dependency, comes from this environment's site-packages below.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    bin_dir = root / "bin"
    # No PYTHONPATH (it could name the checkout), and no TRACETRAIN_* settings from the caller (API keys
    # would change what the gateway answers) except the model cache.
    env = {k: v for k, v in os.environ.items()
           if k not in {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV"}
           and (not k.startswith("TRACETRAIN_") or k == "TRACETRAIN_CACHE")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    cwd = tmp_path_factory.mktemp("cwd")
    query = subprocess.run([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           cwd=cwd, env=env, capture_output=True, text=True, check=True)
    site_packages = Path(query.stdout.strip())
    # This environment's site-packages (where the editable checkout is installed too, inactive there: see
    # the module docstring), after the fresh one's own, so the wheel's tracetrain wins over any other.
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site_packages / "_tracetrain_test_deps.pth").write_text("".join(f"{path}\n" for path in ours))
    venv = FreshVenv(root, bin_dir, site_packages, cwd, env)
    # --ignore-installed: pip sees this environment's (editable) tracetrain through the .pth file and
    # must neither skip the wheel as "already satisfied" nor try to uninstall a distribution it does not own.
    install = venv.run(venv.python, "-m", "pip", "install", "--no-deps", "--ignore-installed", "-q", wheel,
                       timeout=300)
    assert install.returncode == 0, f"pip install failed:\n{install.stdout}\n{install.stderr}"
    return venv


def test_wheel_carries_the_runtime_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    data = _runtime_data_files()
    # The one the gateway reads at import time, named so that an empty package data list cannot pass.
    assert "tracetrain/proxy/templates/chatml_tools.jinja" in data
    assert not [name for name in data if name not in names], f"missing from {wheel.name}: pyproject.toml package-data"


def test_installed_package_is_the_wheel(fresh_venv: FreshVenv) -> None:
    """The gateway imports (it reads the bundled template at import time) from the fresh environment, not
    from the checkout, and the checkout's editable finder is not loaded."""
    probe = ("import json, sys, tracetrain, tracetrain.proxy.gateway, tracetrain.proxy.render as render; "
             "print(json.dumps({'file': tracetrain.__file__, 'template': len(render.BUNDLED_TEMPLATE), "
             "'editable': [m for m in sys.modules if 'editable' in m], 'path': sys.path}))")
    result = fresh_venv.run(fresh_venv.python, "-c", probe)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert Path(seen["file"]).resolve().is_relative_to(fresh_venv.site_packages.resolve()), seen["file"]
    assert not Path(seen["file"]).resolve().is_relative_to(REPO_ROOT), seen["file"]
    assert seen["editable"] == [], "the checkout's editable finder is active in the fresh environment"
    assert str(REPO_ROOT) not in seen["path"]
    assert seen["template"] > 0


@pytest.fixture(scope="module")
def served(fresh_venv: FreshVenv, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`tracetrain serve` from the installed entry point, on the tiny model with the in-process engine; one
    server for the module, since the tests only read from it."""
    tmp_path = tmp_path_factory.mktemp("served")
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(fresh_venv.tracetrain), "serve", "--engine", "transformers", "--model", str(tiny_model_path),
             "--served-model-name", "tiny", "--db-url", f"sqlite:///{tmp_path / 's.db'}", "--port", str(port)],
            cwd=fresh_venv.cwd, env=fresh_venv.env, stdout=log, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # importing torch and transformers on a loaded 2-core machine
        while True:
            if process.poll() is not None:
                pytest.fail(f"tracetrain serve exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"tracetrain serve not healthy in time:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_installed_serve_answers_a_chat_completion(served: str) -> None:
    response = httpx.post(f"{served}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 4})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 1
    assert choices[0]["message"]["role"] == "assistant"


def test_installed_serve_serves_the_console(served: str) -> None:
    for path in ("/ui/", "/ui/console.js", "/ui/vendor/uPlot.iife.min.js"):
        assert httpx.get(f"{served}{path}", timeout=30).status_code == 200, path


@pytest.mark.parametrize(("command", "flag"), [("demo", "--seed"), ("export", "--format")])
def test_installed_cli_help(fresh_venv: FreshVenv, command: str, flag: str) -> None:
    result = fresh_venv.run(fresh_venv.tracetrain, command, "--help")
    assert result.returncode == 0, result.stderr
    assert flag in result.stdout
