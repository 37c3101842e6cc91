"""docs/configuration.md, generated from the settings in tracetrain/config.py.

    python -m tracetrain.config_docs > docs/configuration.md

Each group of `Config` (`engine`: `EngineConfig`, `store`, `gateway`, `train`, `promotion`) becomes one
table, and each of its fields one row: name, type, default, environment variable and the field's docstring.
A field's text is its pydantic `description` when it has one (an explicit `Field(description=…)`, or
`use_attribute_docstrings`), else the string literal right after the field in the class source, read with
`ast`. New fields need nothing here; tests/unit/test_config_docs.py fails until the page is regenerated.
"""

from __future__ import annotations

import ast
import enum
import inspect
import sys
import textwrap
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import NoDecode

from tracetrain.config import RENAMED, Config, groups

COMMAND = "python -m tracetrain.config_docs > docs/configuration.md"
"""How the page is regenerated, run from the repository root with the project's environment."""

_COMPLEX = (list, dict, set, frozenset, tuple)


def field_docstrings(model: type[BaseModel]) -> dict[str, str]:
    """Attribute docstrings of `model` and its base classes: the string literal right after each annotated
    field in the class body, cleaned as `inspect.cleandoc` does. A subclass's text wins over its base's."""
    found: dict[str, str] = {}
    for klass in reversed(inspect.getmro(model)):
        if not klass.__module__.startswith("tracetrain"):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = next((node.body for node in ast.parse(source).body if isinstance(node, ast.ClassDef)), [])
        for statement, after in zip(body, body[1:], strict=False):
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                found[statement.target.id] = inspect.cleandoc(after.value.value)
    return found


def type_text(annotation: Any) -> str:
    """A field's type as a reader writes it: `int`, `list[str]`, `float | None`, `"sync" | "async"`."""
    if annotation is type(None):
        return "None"
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Annotated:
        return type_text(args[0])
    if origin is Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin is Union or origin is types.UnionType:
        return " | ".join(type_text(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_text(a) for a in args)}]" if args else name
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _bounds(field: FieldInfo) -> str:
    """The field's numeric and length constraints (`>= 1`, `> 0, < 1`), from its metadata."""
    words = []
    for item in field.metadata:
        for kind, attr, symbol in ((Ge, "ge", ">="), (Gt, "gt", ">"), (Le, "le", "<="), (Lt, "lt", "<")):
            if isinstance(item, kind):
                words.append(f"{symbol} {getattr(item, attr)}")
        if isinstance(item, MinLen):
            words.append(f"length >= {item.min_length}")
        if isinstance(item, MaxLen):
            words.append(f"length <= {item.max_length}")
    return ", ".join(words)


def yaml_text(value: Any) -> str:
    """A default as it would be written in the YAML file."""
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30)
    except yaml.YAMLError:
        return repr(value)
    return text.strip().removesuffix("...").strip()


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        try:
            value = field.default_factory()  # type: ignore[call-arg]
        except TypeError:  # a factory that takes the validated data: nothing fixed to show
            return "(computed)"
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    return yaml_text(value)


def _nested_model(field: FieldInfo) -> type[BaseModel] | None:
    annotation = field.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _plain_text_env(field: FieldInfo) -> bool:
    """Whether pydantic-settings takes the environment value as it is (`NoDecode`) rather than as JSON."""
    return any(item is NoDecode or isinstance(item, NoDecode) for item in field.metadata)


def _is_complex(annotation: Any) -> bool:
    """Whether pydantic-settings parses the environment value as JSON: lists, dicts, models."""
    origin = get_origin(annotation)
    if origin is Union or origin is types.UnionType or origin is Annotated:
        return any(_is_complex(a) for a in get_args(annotation) if a is not type(None))
    if origin in _COMPLEX or annotation in _COMPLEX:
        return True
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def env_name(name: str, field: FieldInfo, parents: tuple[str, ...] = ()) -> str:
    """The environment variable of a field: `TRACETRAIN_STORE__URL`, `TRACETRAIN_TRAIN__LR`."""
    settings = Config.model_config
    prefix = str(settings.get("env_prefix") or "")
    delimiter = settings.get("env_nested_delimiter")
    alias = field.validation_alias if isinstance(field.validation_alias, str) else field.alias
    if not parents:
        return (alias or f"{prefix}{name}").upper()
    if not delimiter:
        return ""
    return delimiter.join([f"{prefix}{parents[0]}", *parents[1:], name]).upper()


def _words(items: list[str]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _cell(text: str) -> str:
    """One table cell: a single line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{_cell(text)}`" if text else ""


def _rows(model: type[BaseModel], parents: tuple[str, ...] = ()) -> list[str]:
    docs = field_docstrings(model)
    rows = ["| name | type | default | environment variable | description |", "| --- | --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        if _nested_model(field) is not None:
            continue  # its own section
        kind = type_text(field.annotation)
        if bounds := _bounds(field):
            kind = f"{kind}, {bounds}"
        env = env_name(name, field, parents)
        env_cell = _code(env) + (" (JSON)" if env and _is_complex(field.annotation) and not _plain_text_env(field)
                                 else "")
        text = field.description or docs.get(name) or "(undocumented)"
        rows.append(f"| {_code('.'.join((*parents, name)))} | {_code(kind)} | {_code(default_text(field))} | "
                    f"{env_cell} | {_cell(text)} |")
    return rows


def render_configuration_markdown() -> str:
    """The whole page: an introduction, one table per group of settings, then the old flat names."""
    config_docs = field_docstrings(Config)
    plain = [f"{name}.{field_name}" for name, model in groups().items()
             for field_name, field in model.model_fields.items() if _plain_text_env(field)]
    lines = [
        "# Configuration",
        "",
        f"<!-- Generated from tracetrain/config.py by `{COMMAND}`. Do not edit by hand. -->",
        "",
        "Every setting comes from, in rising precedence: its default, the YAML file given with `--config`, "
        "a `TRACETRAIN_…` environment variable, and the command line (a named flag, or `--set KEY=VALUE`). "
        "Settings are grouped by concern: " + _words([f"`{name}`" for name in groups()]) + ". A setting "
        "sits under its group in YAML (`engine:` then `kind: vllm`), uses a double underscore in the "
        "environment (`TRACETRAIN_ENGINE__KIND`), and is set with `--set engine.kind=vllm` (or `--set "
        "lr=1e-4` for a name only the trainer has). An unknown key or a bad combination is refused before "
        "anything starts.",
        "",
        "Defaults are shown as YAML values. Environment values of lists, dicts and groups are JSON "
        "(`TRACETRAIN_GATEWAY__API_KEYS='[\"k1\", \"k2\"]'`)"
        + (f"; {_words([f'`{n}`' for n in plain])} {'takes' if len(plain) == 1 else 'take'} plain text instead "
           "(`TRACETRAIN_ENGINE__URLS=http://a:8000,http://b:8000`)." if plain else ".")
        + " See [operations](operations.md) for how the settings fit together.",
    ]
    for name, model in groups().items():
        intro = [text for text in (config_docs.get(name), inspect.cleandoc(model.__doc__ or "")) if text]
        lines += ["", f"## `{name}`", "", *(f"{_cell(text)}\n" for text in intro), *_rows(model, (name,))]
    lines += ["", "## Old names", "",
              "Before the settings were grouped they were flat. An old name in the YAML file, the environment or "
              "`--set` is refused with its new place:", "",
              "| old name | setting |", "| --- | --- |",
              *(f"| `{old}` | `{new}` |" for old, new in RENAMED.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.write(render_configuration_markdown())


if __name__ == "__main__":
    main()
