"""The real E2B SDK (sync) against `swerl e2b serve` on the local dockerd: sandboxes are pool
leases, commands and files go over the node's Exec, and nothing is left behind."""

from __future__ import annotations

import io
import os
import time

import pytest
from e2b import CommandExitException, Sandbox, SandboxQuery
from e2b.exceptions import NotFoundException
from testkit.e2b import IMAGE_KEY, Face

pytestmark = pytest.mark.docker


def test_a_sandbox_runs_streams_and_keeps_files_then_leaves_nothing(face: Face, base_image: str):
    sandbox = Sandbox.create(base_image, timeout=120, metadata={"suite": "sync"}, **face.opts)
    assert sandbox.sandbox_id.startswith("lse-")
    assert len(face.containers()) == 1

    result = sandbox.commands.run("echo hi; echo oops >&2")
    assert (result.stdout, result.stderr, result.exit_code) == ("hi\n", "oops\n", 0)

    seen: list[str] = []
    streamed = sandbox.commands.run(
        "for i in 1 2 3; do echo line$i; sleep 0.2; done", on_stdout=seen.append
    )
    assert "".join(seen) == streamed.stdout == "line1\nline2\nline3\n"

    with pytest.raises(CommandExitException) as failed:
        sandbox.commands.run("echo partial; exit 3")
    assert failed.value.exit_code == 3 and failed.value.stdout == "partial\n"

    env = sandbox.commands.run('echo "$GREETING" "$PWD"', envs={"GREETING": "hey"}, cwd="/tmp")
    assert env.stdout == "hey /tmp\n"

    blob = os.urandom(1 << 20)
    sandbox.files.write("/tmp/data/blob.bin", blob)
    assert bytes(sandbox.files.read("/tmp/data/blob.bin", format="bytes")) == blob
    sandbox.files.write("/tmp/data/streamed.bin", io.BytesIO(blob), use_octet_stream=True)
    assert bytes(sandbox.files.read("/tmp/data/streamed.bin", format="bytes")) == blob
    sandbox.files.write("/tmp/data/note.txt", "héllo\n")
    assert sandbox.files.read("/tmp/data/note.txt") == "héllo\n"
    names = sorted(entry.name for entry in sandbox.files.list("/tmp/data"))
    assert names == ["blob.bin", "note.txt", "streamed.bin"]
    [entry] = [e for e in sandbox.files.list("/tmp/data") if e.name == "blob.bin"]
    assert entry.size == 1 << 20 and entry.path == "/tmp/data/blob.bin"

    assert sandbox.files.make_dir("/tmp/data/sub") is True
    assert sandbox.files.make_dir("/tmp/data/sub") is False
    assert sandbox.files.exists("/tmp/data/sub") is True
    moved = sandbox.files.rename("/tmp/data/note.txt", "/tmp/data/sub/renamed.txt")
    assert moved.path == "/tmp/data/sub/renamed.txt"
    assert sandbox.files.exists("/tmp/data/note.txt") is False
    sandbox.files.remove("/tmp/data/sub")
    assert sandbox.files.exists("/tmp/data/sub/renamed.txt") is False

    listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "sync"}), **face.opts)
    assert [info.sandbox_id for info in listed.next_items()] == [sandbox.sandbox_id]

    sandbox.set_timeout(60)
    info = sandbox.get_info()
    assert info.metadata == {"suite": "sync"} and info.template_id == base_image
    left = info.end_at.timestamp() - time.time()
    assert 50 < left <= 61

    sandbox.kill()
    with pytest.raises(NotFoundException):
        sandbox.get_info()
    face.assert_nothing_left()


def test_background_commands_wait_take_stdin_reconnect_and_die_by_kill(face: Face, base_image: str):
    created = Sandbox.create(timeout=120, metadata={IMAGE_KEY: base_image}, **face.opts)
    # Another client reaches the same sandbox by its id (its access token comes with it).
    sandbox = Sandbox.connect(created.sandbox_id, **face.opts)
    try:
        handle = sandbox.commands.run("sleep 0.5; echo done", background=True)
        assert [p.pid for p in sandbox.commands.list()] == [handle.pid]
        assert handle.wait().stdout == "done\n"

        reader = sandbox.commands.run("read line; echo got $line", background=True, stdin=True)
        reader.send_stdin("abc\n")
        assert reader.wait().stdout == "got abc\n"

        ticker = sandbox.commands.run(
            "for i in 1 2 3 4; do echo tick$i; sleep 0.4; done", background=True
        )
        time.sleep(0.5)
        ticker.disconnect()
        again = sandbox.commands.connect(ticker.pid)
        rest = again.wait()
        assert rest.exit_code == 0 and "tick4" in rest.stdout

        sleeper = sandbox.commands.run("sleep 60", background=True)
        assert sleeper.kill() is True
        with pytest.raises(CommandExitException):
            sleeper.wait()
        assert sandbox.commands.list() == []
        # The kill reached the command's whole group: nothing sleeps on.
        assert sandbox.commands.run("pgrep -fx 'sleep 60' || echo none").stdout == "none\n"
        assert sandbox.commands.kill(999999) is False
    finally:
        sandbox.kill()
    face.assert_nothing_left()


def test_a_sandbox_ends_when_its_timeout_passes(face: Face, base_image: str):
    sandbox = Sandbox.create(base_image, timeout=2, **face.opts)
    assert sandbox.is_running()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            sandbox.get_info()
        except NotFoundException:
            break
        time.sleep(0.3)
    else:
        pytest.fail("the sandbox outlived its timeout")
    face.assert_nothing_left()


def test_a_snapshot_carries_the_filesystem_into_new_sandboxes(face: Face, base_image: str):
    source = Sandbox.create(base_image, timeout=120, **face.opts)
    try:
        source.files.write("/work/state.txt", "before the snapshot")
        snapshot = source.create_snapshot()
        source.files.write("/work/state.txt", "after the snapshot")
        copy = Sandbox.create(snapshot.snapshot_id, timeout=60, **face.opts)
        try:
            assert copy.files.read("/work/state.txt") == "before the snapshot"
            assert copy.commands.run("echo fresh shell").stdout == "fresh shell\n"
        finally:
            copy.kill()
        Sandbox.delete_snapshot(snapshot.snapshot_id, **face.opts)
    finally:
        source.kill()
    face.assert_nothing_left()
