"""The small durable stores of the services (the exec node's, the pool's): SQLite in WAL mode.

Each store is one connection shared by the asyncio loop and the threads the services hand blocking
work to, so every statement runs under one lock; each call is one short autocommit transaction
(microseconds), which is why the stores stay synchronous. A store subclasses `SqliteStore` with
its schema and adds its typed reads and writes on top of `execute` and `rows`.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

MEMORY = ":memory:"


class SqliteStore:
    """A WAL-mode SQLite database at `path` (":memory:" for none) with `schema` applied."""

    def __init__(
        self,
        path: Path | str,
        schema: str,
        *,
        synchronous: Literal["OFF", "NORMAL", "FULL"] | None = None,
    ) -> None:
        if str(path) != MEMORY:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # Autocommit (isolation_level=None): a statement is its own transaction; shared across
        # threads, serialised by the lock below.
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            if synchronous is not None:
                # NORMAL in WAL mode may lose the last commits on power loss, never consistency.
                self._db.execute(f"PRAGMA synchronous={synchronous}")
            self._db.executescript(schema)

    def execute(self, sql: str, parameters: Sequence[Any] = ()) -> None:
        with self._lock:
            self._db.execute(sql, parameters)

    def rows(self, sql: str, parameters: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, parameters).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()
