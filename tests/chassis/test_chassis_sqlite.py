"""The stores' shared SQLite scaffold, and the two stores built on it surviving a reopen."""

from __future__ import annotations

import sqlite3

import pytest

from swerl.chassis.sqlite import SqliteStore
from swerl.exec.store import NodeStore, StoredSandbox
from swerl.pool.store import PoolStore, StoredNode, StoredTarget

SCHEMA = "CREATE TABLE IF NOT EXISTS kv (k TEXT PRIMARY KEY, v TEXT NOT NULL);"


def test_store_is_in_wal_mode_with_the_asked_durability(tmp_path):
    path = tmp_path / "deep" / "er" / "store.sqlite"  # Missing folders are made.
    store = SqliteStore(path, SCHEMA, synchronous="NORMAL")
    assert store.rows("PRAGMA journal_mode") == [("wal",)]
    assert store.rows("PRAGMA synchronous") == [(1,)]  # NORMAL
    store.close()
    default = SqliteStore(tmp_path / "default.sqlite", SCHEMA)
    assert default.rows("PRAGMA synchronous") == [(2,)]  # SQLite's own default, FULL
    default.close()


def test_rows_written_are_read_back_after_a_reopen(tmp_path):
    path = tmp_path / "store.sqlite"
    store = SqliteStore(path, SCHEMA)
    store.execute("INSERT INTO kv VALUES (?, ?)", ("a", "1"))
    store.close()
    again = SqliteStore(path, SCHEMA)  # The schema is applied again without harm.
    assert again.rows("SELECT * FROM kv WHERE k = ?", ("a",)) == [("a", "1")]
    again.close()


def test_memory_store_makes_no_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = SqliteStore(":memory:", SCHEMA)
    store.execute("INSERT INTO kv VALUES (?, ?)", ("a", "1"))
    assert store.rows("SELECT v FROM kv") == [("1",)]
    assert list(tmp_path.iterdir()) == []
    store.close()


def test_closed_store_refuses_statements(tmp_path):
    store = SqliteStore(tmp_path / "s.sqlite", SCHEMA)
    store.close()
    with pytest.raises(sqlite3.ProgrammingError):
        store.rows("SELECT * FROM kv")


def test_node_and_pool_stores_keep_their_rows_across_a_reopen(tmp_path):
    node = NodeStore(tmp_path / "node.sqlite")
    node.put(StoredSandbox("sb-1", "c-1", "req-1", 123.5))
    node.bind("sb-1", "lse-1", "me", "i-1")
    node.set_expiry("sb-1", 200.0)
    node.put(StoredSandbox("sb-2", "c-2", "", 1.0))
    node.delete("sb-2")
    node.close()
    node = NodeStore(tmp_path / "node.sqlite")
    assert node.all() == {"sb-1": StoredSandbox("sb-1", "c-1", "req-1", 200.0)}
    assert node.bindings() == {"sb-1": ("lse-1", "me", "i-1")}
    assert node.rows("PRAGMA synchronous") == [(1,)]
    node.close()

    pool = PoolStore(tmp_path / "pool.sqlite")
    pool.put_node(StoredNode("n-1", "h:1", 4, {"zone": "a"}, True))
    pool.put_target(StoredTarget("img:1", "k", {"workdir": "/w"}, 2))
    pool.put_target(StoredTarget("img:2", "k", {}, 1))
    pool.put_target(StoredTarget("img:2", "k", {}, 0))  # A zero count removes the target.
    pool.close()
    pool = PoolStore(tmp_path / "pool.sqlite")
    assert pool.nodes() == [StoredNode("n-1", "h:1", 4, {"zone": "a"}, True)]
    assert pool.targets() == [StoredTarget("img:1", "k", {"workdir": "/w"}, 2)]
    pool.close()
