"""Every flag of every subcommand says what it does: the help comes from its setting's docstring."""

from __future__ import annotations

import argparse

from tracetrain.cli import FLAGS, _parser, flag_overrides
from tracetrain.config import EngineConfig, setting_field


def test_every_flag_has_help_text() -> None:
    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {' '.join(action.option_strings)}"
               for name, sub in commands.choices.items() for action in sub._actions
               if action.option_strings and len((action.help or "").strip(" .")) < 10]
    assert missing == []


def test_a_flags_help_is_its_settings_docstring() -> None:
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    engine = next(a for a in commands.choices["serve"]._actions if "--engine" in a.option_strings)
    docstring = " ".join((EngineConfig.model_fields["kind"].description or "").split())
    assert engine.help and engine.help.removesuffix(" Setting: engine.kind.").rstrip(".") in docstring
    for path in FLAGS.values():
        assert setting_field(path).description, path


def test_flags_set_their_settings_and_win_over_set() -> None:
    args = _parser().parse_args(["serve", "--engine", "vllm", "--engine-url", "http://a:1", "--engine-url",
                                 "http://b:2", "--port", "9001", "--workers", "2", "--set", "gateway.port=1",
                                 "--set", "engine.timeout_s=5", "--set", "lr=1e-4", "--db-url", "sqlite:///x.db"])
    assert flag_overrides(args) == {
        "engine": {"kind": "vllm", "urls": ["http://a:1", "http://b:2"], "timeout_s": 5},
        "gateway": {"port": 9001, "workers": 2}, "train": {"lr": "1e-4"}, "store": {"url": "sqlite:///x.db"}}


def test_a_cpu_range_flag_reaches_its_setting_as_written() -> None:
    """`--gateway-cpus 0-1` is text for the setting's own reader, not a number argparse refuses."""
    from tracetrain.config import load_config

    args = _parser().parse_args(["serve", "--gateway-cpus", "0", "--workers", "2", "--replicas", "1"])
    overrides = flag_overrides(args)
    assert overrides["gateway"] == {"cpus": "0", "workers": 2} and overrides["engine"] == {"replicas": 1}
    assert load_config(**overrides).gateway.cpus == [0]
    assert _parser().parse_args(["serve", "--gateway-cpus", "0-1"]) is not None
