"""docs/configuration.md is generated from tracetrain/config.py (tracetrain/config_docs.py) and must match it."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from tracetrain.config import RENAMED, StoreConfig, TrainConfig, groups, load_config
from tracetrain.config_docs import COMMAND, env_name, field_docstrings, render_configuration_markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_page_matches_config() -> None:
    expected = render_configuration_markdown()
    if not PAGE.exists():
        pytest.fail(f"docs/configuration.md is missing. Generate it from the repository root with: {COMMAND}")
    actual = PAGE.read_text(encoding="utf-8")
    if actual != expected:
        diff = "\n".join(list(difflib.unified_diff(actual.splitlines(), expected.splitlines(), "docs/configuration.md",
                                                   "generated", lineterm="", n=0))[:40])
        pytest.fail(f"docs/configuration.md is out of date with tracetrain/config.py. Regenerate it from the "
                    f"repository root with: {COMMAND}\n{diff}")


def test_every_field_is_on_the_page_with_its_docstring() -> None:
    page = render_configuration_markdown()
    for group, model in groups().items():
        docs = field_docstrings(model)
        for name in model.model_fields:
            assert f"| `{group}.{name}` |" in page, name
            if name in docs:
                assert " ".join(docs[name].split())[:60].replace("|", "\\|") in page, name


def test_documented_environment_variables_set_the_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    lr = env_name("lr", TrainConfig.model_fields["lr"], ("train",))
    db_url = env_name("url", StoreConfig.model_fields["url"], ("store",))
    assert (lr, db_url) == ("TRACETRAIN_TRAIN__LR", "TRACETRAIN_STORE__URL")
    monkeypatch.setenv(lr, "3e-5")
    monkeypatch.setenv(db_url, "sqlite:///elsewhere.db")
    config = load_config()
    assert config.train.lr == 3e-5 and config.store.url == "sqlite:///elsewhere.db"


def test_every_old_name_points_at_a_setting_that_exists() -> None:
    page = render_configuration_markdown()
    for old, new in RENAMED.items():
        group, name = new.split(".")
        assert name in groups()[group].model_fields, new
        assert f"| `{old}` | `{new}` |" in page, old
