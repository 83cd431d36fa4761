"""The pool's small durable store (SQLite, WAL): what the nodes cannot tell a restarted pool.

Leases are NOT stored here: the nodes' labelled sandboxes (and their stores' bindings) are the
truth, and a restarted pool rebuilds its lease table from them. What only the pool knows is
which nodes registered themselves (and whether an operator drained them) and the Prewarm
targets; both are kept here and re-read on start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from swerl.chassis.sqlite import SqliteStore

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id   TEXT PRIMARY KEY,
    address   TEXT NOT NULL,
    capacity  INTEGER NOT NULL,
    labels    TEXT NOT NULL,
    drained   INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS prewarm (
    image     TEXT NOT NULL,
    spec_key  TEXT NOT NULL,
    spec      TEXT NOT NULL,
    count     INTEGER NOT NULL,
    PRIMARY KEY (image, spec_key)
);
"""


@dataclass(frozen=True)
class StoredNode:
    node_id: str
    address: str
    capacity: int
    labels: dict[str, str]
    drained: bool


@dataclass(frozen=True)
class StoredTarget:
    image: str
    spec_key: str
    spec: dict
    count: int


class PoolStore(SqliteStore):
    """Tiny synchronous store; each call is one short transaction."""

    def __init__(self, path: Path | str) -> None:
        super().__init__(path, SCHEMA)

    def put_node(self, node: StoredNode) -> None:
        self.execute(
            "INSERT OR REPLACE INTO nodes VALUES (?, ?, ?, ?, ?)",
            (node.node_id, node.address, node.capacity, json.dumps(node.labels), int(node.drained)),
        )

    def nodes(self) -> list[StoredNode]:
        rows = self.rows("SELECT * FROM nodes")
        return [StoredNode(r[0], r[1], r[2], json.loads(r[3]), bool(r[4])) for r in rows]

    def put_target(self, target: StoredTarget) -> None:
        if target.count <= 0:
            self.execute(
                "DELETE FROM prewarm WHERE image = ? AND spec_key = ?",
                (target.image, target.spec_key),
            )
            return
        self.execute(
            "INSERT OR REPLACE INTO prewarm VALUES (?, ?, ?, ?)",
            (target.image, target.spec_key, json.dumps(target.spec), target.count),
        )

    def targets(self) -> list[StoredTarget]:
        rows = self.rows("SELECT * FROM prewarm")
        return [StoredTarget(r[0], r[1], json.loads(r[2]), r[3]) for r in rows]
