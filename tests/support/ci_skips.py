"""Skips are for machines that lack an optional part; in CI a skip means a setup step did not run.

On a laptop a test whose environment is missing (vLLM, PostgreSQL, torch, peft) skips, and `-rs` in
scripts/test.sh lists the reasons. With `CI=true` the same skip fails instead, naming the reason, so a
broken setup cannot pass CI with half the suite silently skipped. Skip sites take their reasons from
tests/support/setup_steps.py, so every message says which setup step is missing.

This module is a pytest plugin: tests/conftest.py loads it through `pytest_plugins`, and
tests/unit/test_ci_skips.py loads the very same module into a pytester run to check it. Nothing else
imports it, so pytest can import it as a plugin (with assertion rewriting) itself.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping

import pytest


def in_ci(environ: Mapping[str, str] = os.environ) -> bool:
    """`CI=true` is what GitHub Actions and .ci/run set; "1" is accepted too."""
    return environ.get("CI", "").strip().lower() in {"true", "1"}


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason of a skipped report, with where the skip was raised."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip's longrepr is (path, lineno, "Skipped: <reason>")
        path, lineno, message = longrepr
        return f"{message.removeprefix('Skipped: ')} (skipped at {path}:{lineno})"
    return str(longrepr)


def fail_skip_in_ci(report: pytest.TestReport | pytest.CollectReport, environ: Mapping[str, str] = os.environ) -> None:
    """Turn a skipped report into a failed one when CI is on. An xfail is also reported as skipped
    (with `wasxfail` set); it is an expected failure, not a missing setup step, so it stays."""
    if not report.skipped or hasattr(report, "wasxfail") or not in_ci(environ):
        return
    reason = skip_reason(report)
    report.outcome = "failed"
    report.longrepr = f"CI=true turns this skip into a failure, since in CI it means a setup step is missing: {reason}"


# tryfirst makes these the outermost wrappers, so they see the report after pytest's own skipping
# plugin has marked xfails (wasxfail), and they run on every report: test phases and collection.
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport,
                                                                                            pytest.TestReport]:
    report = yield
    fail_skip_in_ci(report)
    return report


# A module-level `pytest.importorskip` skips during collection, before there is a test report; in CI
# it becomes a collection error (which stops the run, with the reason printed).
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, pytest.CollectReport,
                                                                          pytest.CollectReport]:
    report = yield
    fail_skip_in_ci(report)
    return report
