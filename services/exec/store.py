"""The exec node's small durable store (SQLite, WAL): what Docker labels cannot hold.

Labels are fixed when a container is created, so anything that changes later (a renewed expiry)
or must survive a node restart without asking Docker (idempotency keys) lives here. The node
re-reads it on start and reconciles it with the labelled containers it finds.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    sandbox_id   TEXT PRIMARY KEY,
    container_id TEXT NOT NULL,
    request_id   TEXT,
    expire_time  REAL NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS sandboxes_request_id
    ON sandboxes(request_id) WHERE request_id IS NOT NULL AND request_id != '';
CREATE TABLE IF NOT EXISTS bindings (
    sandbox_id   TEXT PRIMARY KEY,
    lease_id     TEXT NOT NULL,
    owner        TEXT NOT NULL,
    instance_id  TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class StoredSandbox:
    sandbox_id: str
    container_id: str
    request_id: str
    expire_time: float


class NodeStore:
    """Tiny synchronous store; each call is one short transaction (microseconds)."""

    def __init__(self, path: Path | str) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)

    def put(self, row: StoredSandbox) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO sandboxes VALUES (?, ?, ?, ?)",
                (row.sandbox_id, row.container_id, row.request_id, row.expire_time),
            )

    def set_expiry(self, sandbox_id: str, expire_time: float) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE sandboxes SET expire_time = ? WHERE sandbox_id = ?",
                (expire_time, sandbox_id),
            )

    def delete(self, sandbox_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,))
            self._db.execute("DELETE FROM bindings WHERE sandbox_id = ?", (sandbox_id,))

    def bind(self, sandbox_id: str, lease_id: str, owner: str, instance_id: str) -> None:
        """Records the lease a sandbox was handed to after its creation (labels are fixed)."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO bindings VALUES (?, ?, ?, ?)",
                (sandbox_id, lease_id, owner, instance_id),
            )

    def bindings(self) -> dict[str, tuple[str, str, str]]:
        """sandbox_id -> (lease_id, owner, instance_id)."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM bindings").fetchall()
        return {r[0]: (r[1], r[2], r[3]) for r in rows}

    def all(self) -> dict[str, StoredSandbox]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM sandboxes").fetchall()
        return {r[0]: StoredSandbox(*r) for r in rows}

    def close(self) -> None:
        with self._lock:
            self._db.close()
