"""The engine's per-request whitespace bound on JSON constraints (engines/vllm.py `json_constraint`)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tracetrain.config import Config, load_config, parse_set
from tracetrain.engines.vllm import json_constraint

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _format(constraint: dict) -> dict:
    (key,) = constraint
    assert key == "structural_tag"
    tag = json.loads(constraint["structural_tag"])
    assert tag["type"] == "structural_tag"
    return tag["format"]


def test_a_schema_becomes_a_structural_tag_with_the_bound() -> None:
    assert _format(json_constraint({"json": SCHEMA}, 4)) == {
        "type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 4}


def test_a_schema_given_as_text_is_parsed() -> None:
    assert _format(json_constraint({"json": json.dumps(SCHEMA)}, 2))["json_schema"] == SCHEMA


def test_json_object_mode_is_any_object() -> None:
    assert _format(json_constraint({"json_object": True}, 4))["json_schema"] == {"type": "object"}


def test_without_a_bound_or_for_other_constraints_nothing_changes() -> None:
    assert json_constraint({"json": SCHEMA}, None) == {"json": SCHEMA}
    assert json_constraint({"regex": "[a-z]+"}, 4) == {"regex": "[a-z]+"}


def test_the_bound_is_a_setting_checked_when_the_config_loads() -> None:
    assert Config().engine.json_max_whitespace == 64
    unset = load_config(**parse_set(["engine.json_max_whitespace=null"]))  # `--set` may unset
    assert unset.engine.json_max_whitespace is None
    with pytest.raises(ValidationError, match="json_max_whitespace"):
        Config(engine={"json_max_whitespace": 0})  # xgrammar refuses a zero bound; compact JSON is the server's flag
