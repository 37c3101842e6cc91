"""Every flag of every subcommand says what it does: the help comes from its setting's docstring."""

from __future__ import annotations

import argparse

from tracetrain.cli import _parser
from tracetrain.config import Config


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
    docstring = " ".join((Config.model_fields["engine"].description or "").split())
    assert engine.help and engine.help.rstrip(".") in docstring
