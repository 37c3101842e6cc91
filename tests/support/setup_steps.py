"""Skip reasons that name the setup step that is missing, shared by every skip site.

In CI those skips fail (tests/support/ci_skips.py), and the message is what tells the reader what to fix.
"""

TORCH_MISSING = "torch is missing: scripts/setup.sh installs torch==2.13.0 into .venv"
PEFT_MISSING = "peft is missing: scripts/setup.sh installs it into .venv (pip install -e '.[dev]', the train extra)"
VLLM_MISSING = "vLLM is not installed: run scripts/setup.sh (it creates .venv-vllm), or set TRACETRAIN_VLLM_PYTHON"
POSTGRES_MISSING = ("PostgreSQL binaries (initdb, pg_ctl) are not installed: "
                    "scripts/setup.sh installs them with apt-get when run as root")
SETUPTOOLS_MISSING = "setuptools is missing: scripts/setup.sh installs it into .venv (the dev extra)"
CHROMIUM_MISSING = ("chromium is not installed: scripts/setup.sh installs Debian's chromium with apt-get when run "
                    "as root (the console's browser test drives it through Playwright)")
PLAYWRIGHT_MISSING = "playwright is missing: scripts/setup.sh installs it into .venv (the dev extra)"
