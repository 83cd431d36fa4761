"""The exec node's small durable store (SQLite, WAL): what Docker labels cannot hold.

Labels are fixed when a container is created, so anything that changes later (a renewed expiry)
or must survive a node restart without asking Docker (idempotency keys) lives here. The node
re-reads it on start and reconciles it with the labelled containers it finds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from swerl.chassis.sqlite import SqliteStore

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
-- The image cache's memory: an image the node pulled or created a sandbox from, by Docker id.
-- last_use orders eviction (least recently used first) across node restarts.
CREATE TABLE IF NOT EXISTS images (
    image_id     TEXT PRIMARY KEY,
    last_use     REAL NOT NULL,
    use_count    INTEGER NOT NULL DEFAULT 0
);
"""


@dataclass(frozen=True)
class ImageUse:
    last_use: float
    use_count: int


@dataclass(frozen=True)
class StoredSandbox:
    sandbox_id: str
    container_id: str
    request_id: str
    expire_time: float


class NodeStore(SqliteStore):
    """Tiny synchronous store; each call is one short transaction (microseconds)."""

    def __init__(self, path: Path | str) -> None:
        super().__init__(path, SCHEMA, synchronous="NORMAL")

    def put(self, row: StoredSandbox) -> None:
        self.execute(
            "INSERT OR REPLACE INTO sandboxes VALUES (?, ?, ?, ?)",
            (row.sandbox_id, row.container_id, row.request_id, row.expire_time),
        )

    def set_expiry(self, sandbox_id: str, expire_time: float) -> None:
        self.execute(
            "UPDATE sandboxes SET expire_time = ? WHERE sandbox_id = ?", (expire_time, sandbox_id)
        )

    def delete(self, sandbox_id: str) -> None:
        self.execute("DELETE FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,))
        self.execute("DELETE FROM bindings WHERE sandbox_id = ?", (sandbox_id,))

    def bind(self, sandbox_id: str, lease_id: str, owner: str, instance_id: str) -> None:
        """Records the lease a sandbox was handed to after its creation (labels are fixed)."""
        self.execute(
            "INSERT OR REPLACE INTO bindings VALUES (?, ?, ?, ?)",
            (sandbox_id, lease_id, owner, instance_id),
        )

    def bindings(self) -> dict[str, tuple[str, str, str]]:
        """sandbox_id -> (lease_id, owner, instance_id)."""
        return {r[0]: (r[1], r[2], r[3]) for r in self.rows("SELECT * FROM bindings")}

    def all(self) -> dict[str, StoredSandbox]:
        return {r[0]: StoredSandbox(*r) for r in self.rows("SELECT * FROM sandboxes")}

    def touch_image(self, image_id: str, when: float, *, used: bool) -> None:
        """Marks an image recently used; `used` counts a sandbox made from it (a pull does not)."""
        self.execute(
            "INSERT INTO images VALUES (?, ?, ?) ON CONFLICT(image_id) DO UPDATE SET"
            " last_use = MAX(last_use, excluded.last_use),"
            " use_count = use_count + excluded.use_count",
            (image_id, when, 1 if used else 0),
        )

    def image_uses(self) -> dict[str, ImageUse]:
        rows = self.rows("SELECT image_id, last_use, use_count FROM images")
        return {r[0]: ImageUse(r[1], r[2]) for r in rows}

    def forget_image(self, image_id: str) -> None:
        self.execute("DELETE FROM images WHERE image_id = ?", (image_id,))
