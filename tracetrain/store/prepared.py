"""Core statements compiled once per dialect and run on the driver's cursor.

The gateway writes one session row and one call row per request and reads one session row per new
session. Through SQLAlchemy's `Connection.execute` each statement costs a cache-key walk, an execution
context and result set-up, which on SQLite took more of the writer's CPU than the SQL itself
(bench/commit_cost.py, in git history at af20f58). Here the
SQL string and the bind processors come from SQLAlchemy's own compiler and types, once; each execution
only runs those processors and hands the values to the driver, inside the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler


@dataclass(frozen=True)
class _Compiled:
    sql: str
    names: tuple[str, ...]
    """Parameter names, in the driver's positional order when `positional`."""
    positional: bool
    processors: tuple[Callable[[Any], Any] | None, ...]
    fixed: dict[str, Any]
    """Values the statement carries itself (a LIMIT's), used when the parameters leave them out."""


class Prepared:
    """One statement; `keys` fixes an INSERT's columns (its rows must carry exactly those keys)."""

    def __init__(self, statement: ClauseElement, keys: Sequence[str] | None = None) -> None:
        self.statement = statement
        self.keys = list(keys) if keys is not None else None
        self._by_dialect: dict[str, _Compiled] = {}

    def _compiled(self, dialect: Dialect) -> _Compiled:
        found = self._by_dialect.get(dialect.name)
        if found is None:
            compiled = cast(SQLCompiler, self.statement.compile(dialect=dialect, column_keys=self.keys))
            names = tuple(compiled.positiontup or ()) if compiled.positional else tuple(compiled.binds)
            processors = tuple(compiled.binds[name].type.dialect_impl(dialect).bind_processor(dialect)
                               for name in names)
            fixed = {name: bind.value for name, bind in compiled.binds.items() if not bind.required}
            found = _Compiled(str(compiled), names, compiled.positional, processors, fixed)
            self._by_dialect[dialect.name] = found
        return found

    def execute(self, conn: Connection, params: dict[str, Any] | list[dict[str, Any]]) -> Any:
        """Run with one parameter dict, or many (executemany); returns the driver's cursor."""
        compiled = self._compiled(conn.dialect)
        cursor = conn.connection.cursor()
        if isinstance(params, list):
            cursor.executemany(compiled.sql, [self._values(compiled, p) for p in params])
        else:
            cursor.execute(compiled.sql, self._values(compiled, params))
        return cursor

    @staticmethod
    def _values(compiled: _Compiled, params: dict[str, Any]) -> Any:
        raw = [params[name] if name in params else compiled.fixed[name] for name in compiled.names]
        values = [value if process is None else process(value)
                  for value, process in zip(raw, compiled.processors, strict=True)]
        return values if compiled.positional else dict(zip(compiled.names, values, strict=True))
