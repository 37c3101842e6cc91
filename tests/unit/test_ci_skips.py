"""With CI=true a skip fails and names the missing setup step; without it, skips stay skips.

The pytester runs load tests.support.ci_skips, the same plugin tests/conftest.py registers for the real
suite, so this checks the hooks the suite actually runs with, not a copy.
"""

from __future__ import annotations

import pytest

PLUGIN = "tests.support.ci_skips"

SKIPPING_TESTS = '''
import pytest

@pytest.fixture(scope="session")
def cluster():
    pytest.skip("cluster binaries are missing: run setup step A")

def test_skips_in_body():
    pytest.skip("widget is missing: run setup step B")

@pytest.mark.skipif(True, reason="gadget is missing: run setup step C")
def test_skipif_marker():
    pass

def test_skips_in_fixture(cluster):
    pass

@pytest.mark.xfail(reason="a known bug, not a missing setup step")
def test_expected_failure():
    assert False

def test_passes():
    pass
'''

SKIPPING_MODULE = '''
import pytest

pytest.importorskip("tt_no_such_module", reason="tt_no_such_module is missing: run setup step D")

def test_never_collected():
    pass
'''


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str | None,
         source: str) -> pytest.RunResult:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    pytester.makeconftest(f"pytest_plugins = [{PLUGIN!r}]")
    pytester.makepyfile(test_setup_steps=source)
    # The plugin is already imported by this outer run, so the inner one cannot assert-rewrite it (a
    # warning, not a problem); the inner tests are synchronous, so pytest-asyncio is left out.
    return pytester.runpytest("-rs", "-p", "no:cacheprovider", "-p", "no:asyncio",
                              "-W", "ignore::pytest.PytestAssertRewriteWarning")


def test_the_suite_runs_with_the_plugin(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.pluginmanager.get_plugin(PLUGIN) is not None, "tests/conftest.py must load it"


def test_in_ci_every_skip_fails_with_its_reason(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(pytester, monkeypatch, "true", SKIPPING_TESTS)
    # A skip in a test body fails the test; a skipif marker or a skip in a fixture fails the setup
    # phase, which pytest reports as an error. The xfail is not a skip and stays one.
    result.assert_outcomes(passed=1, failed=1, errors=2, xfailed=1)
    result.stdout.fnmatch_lines_random([
        "*CI=true turns this skip into a failure*widget is missing: run setup step B*",
        "*CI=true turns this skip into a failure*gadget is missing: run setup step C*",
        "*CI=true turns this skip into a failure*cluster binaries are missing: run setup step A*",
    ])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_in_ci_a_module_level_skip_is_a_collection_error(pytester: pytest.Pytester,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(pytester, monkeypatch, "true", SKIPPING_MODULE)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*CI=true turns this skip into a failure*tt_no_such_module is missing: run setup step D*"])
    assert result.ret != pytest.ExitCode.OK


@pytest.mark.parametrize("ci", [None, "false", ""])
def test_outside_ci_skips_stay_skips_and_are_listed(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                                    ci: str | None) -> None:
    result = _run(pytester, monkeypatch, ci, SKIPPING_TESTS)
    result.assert_outcomes(passed=1, skipped=3, xfailed=1)
    result.stdout.fnmatch_lines_random([  # -rs names each reason in the summary
        "SKIPPED * run setup step A",
        "SKIPPED * run setup step B",
        "SKIPPED * run setup step C",
    ])
    assert result.ret == pytest.ExitCode.OK


def test_outside_ci_a_module_level_skip_stays_a_skip(pytester: pytest.Pytester,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(pytester, monkeypatch, None, SKIPPING_MODULE)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED * tt_no_such_module is missing: run setup step D"])
