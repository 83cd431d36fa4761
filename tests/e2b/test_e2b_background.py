"""Background commands through the real E2B SDK do not hold the sandbox: they run detached,
foreground and other background commands run (and return) while they do, their output comes
back exact, a kill ends only its own command, and nothing is left behind."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
from e2b import AsyncSandbox, CommandExitException, Sandbox
from testkit.e2b import Face

from swerl.e2b.scripts import DONE_FIFO, RECORD_DIR

pytestmark = pytest.mark.docker

# A foreground `echo` behind a running background command returns within this (it waited for
# the background command's end before: seconds).
QUICK_S = 2.0


# The files of ended processes are removed in batches, off a quick command's path: once the
# sandbox's command lane has been idle for a moment (procs.CLEANUP_IDLE_S), or with a later poll.
CLEANUP_WITHIN_S = 5.0


@contextlib.contextmanager
def held_sandbox(face: Face, base_image: str) -> Iterator[Sandbox]:
    """A sandbox of the base image for a test's body, killed after it; then nothing of it is
    left (no container, no lease)."""
    sandbox = Sandbox.create(base_image, timeout=120, **face.opts)
    try:
        yield sandbox
    finally:
        sandbox.kill()
    face.assert_nothing_left()


def leftovers(sandbox: Sandbox) -> list[str]:
    """The face's per-process files still in the sandbox (listed without running a process)
    once its batched cleanup has had CLEANUP_WITHIN_S to run: all but the done FIFO, which
    stays for the sandbox's life."""
    deadline = time.monotonic() + CLEANUP_WITHIN_S
    while True:
        names = [e.name for e in sandbox.files.list(RECORD_DIR) if e.path != DONE_FIFO]
        if not names or time.monotonic() > deadline:
            return names
        time.sleep(0.05)


def test_foreground_commands_run_while_background_ones_do(face: Face, base_image: str):
    with held_sandbox(face, base_image) as sandbox:
        late = sandbox.commands.run(
            "until [ -e /tmp/go ]; do sleep 0.1; done; echo done", background=True
        )
        server = sandbox.commands.run(
            # (the count is replaced whole, so a reader never sees it empty)
            "i=0; while true; do i=$((i+1)); echo tick$i; echo $i >/tmp/ticks.new;"
            " mv -f /tmp/ticks.new /tmp/ticks; sleep 0.1; done",
            background=True,
        )
        for n in range(5):
            began = time.monotonic()
            result = sandbox.commands.run(f"echo fg{n}; echo err{n} >&2")
            assert (result.stdout, result.stderr) == (f"fg{n}\n", f"err{n}\n")
            assert time.monotonic() - began < QUICK_S
        # The server loop really runs meanwhile.
        first = int(sandbox.commands.run("cat /tmp/ticks").stdout)
        time.sleep(0.5)
        assert int(sandbox.commands.run("cat /tmp/ticks").stdout) > first
        assert sorted(p.pid for p in sandbox.commands.list()) == sorted([late.pid, server.pid])

        # A kill of one leaves the other running.
        assert server.kill() is True
        with pytest.raises(CommandExitException) as killed:
            server.wait()
        # envd's end of a process its SendSignal killed: -1, `signal: killed`.
        assert (killed.value.exit_code, killed.value.error) == (-1, "signal: killed")
        assert killed.value.stdout.startswith("tick1\ntick2\n")
        ticks = killed.value.stdout.splitlines()
        assert ticks == [f"tick{i}" for i in range(1, len(ticks) + 1)]
        assert [p.pid for p in sandbox.commands.list()] == [late.pid]
        # The other one still runs (it ends only when told to).
        sandbox.files.write("/tmp/go", "")

        done = late.wait()
        assert (done.stdout, done.stderr, done.exit_code) == ("done\n", "", 0)
        assert sandbox.commands.list() == []
        # Neither the killed command's group nor any process's files are left in the sandbox.
        assert sandbox.commands.run("pgrep -f 'tick' || echo none").stdout == "none\n"
        assert leftovers(sandbox) == []


def test_two_background_commands_at_once_give_their_exact_output(face: Face, base_image: str):
    with held_sandbox(face, base_image) as sandbox:
        # Large enough for many polls; stdout and stderr of each kept apart.
        counting = sandbox.commands.run("seq 1 200000; echo tail >&2; exit 4", background=True)
        lines = sandbox.commands.run(
            "for i in $(seq 1 30); do printf 'l%03d|' $i; printf 'e%d\\n' $i >&2; sleep 0.02; done",
            background=True,
        )
        assert sandbox.commands.run("echo between").stdout == "between\n"
        # Commands that replace their shell or its EXIT trap still report their end exactly.
        assert sandbox.commands.run("trap 'echo bye' EXIT; echo hi").stdout == "hi\nbye\n"
        assert sandbox.commands.run("exec echo replaced").stdout == "replaced\n"
        with pytest.raises(CommandExitException) as exited:
            sandbox.commands.run("echo out; exit 7")
        assert (exited.value.exit_code, exited.value.stdout) == (7, "out\n")
        with pytest.raises(CommandExitException) as failed:
            counting.wait()
        expected = "".join(f"{i}\n" for i in range(1, 200001))
        assert failed.value.exit_code == 4
        assert failed.value.stdout == expected
        assert failed.value.stderr == "tail\n"
        result = lines.wait()
        assert result.stdout == "".join(f"l{i:03d}|" for i in range(1, 31))
        assert result.stderr == "".join(f"e{i}\n" for i in range(1, 31))
        assert leftovers(sandbox) == []


def test_a_long_foreground_command_streams_and_reconnects_while_another_runs(
    face: Face, base_image: str
):
    with held_sandbox(face, base_image) as sandbox:
        reader = sandbox.commands.run(
            "while read -r line; do echo got:$line; done; echo eof", background=True, stdin=True
        )
        seen: list[str] = []
        streamed = sandbox.commands.run(
            "for i in 1 2 3; do echo s$i; sleep 0.3; done", on_stdout=seen.append
        )
        assert "".join(seen) == streamed.stdout == "s1\ns2\ns3\n"
        # seen as it came, not at the end
        assert len(seen) >= 2
        sandbox.commands.send_stdin(reader.pid, "one\n")
        reader.disconnect()
        again = sandbox.commands.connect(reader.pid)
        sandbox.commands.send_stdin(reader.pid, "two\n")
        sandbox.commands.close_stdin(reader.pid)
        result = again.wait()
        assert result.exit_code == 0 and result.stdout.endswith("got:two\neof\n")
        assert leftovers(sandbox) == []


def test_a_running_background_command_ends_with_its_sandbox(face: Face, base_image: str):
    sandbox = Sandbox.create(base_image, timeout=120, **face.opts)
    handle = sandbox.commands.run("sleep 60", background=True)
    assert sandbox.commands.run("echo still here").stdout == "still here\n"
    sandbox.kill()
    with pytest.raises(Exception):  # noqa: B017 - the SDK's error for a vanished sandbox
        handle.wait()
    face.assert_nothing_left()


async def test_the_async_sdk_runs_background_commands_side_by_side(face: Face, base_image: str):
    sandbox = await AsyncSandbox.create(base_image, timeout=120, **face.opts)
    try:
        slow = await sandbox.commands.run("sleep 2; echo slow", background=True)
        fast = await sandbox.commands.run("echo fast", background=True)
        began = time.monotonic()
        assert (await fast.wait()).stdout == "fast\n"
        assert time.monotonic() - began < QUICK_S
        both = await asyncio.gather(
            sandbox.commands.run("sleep 0.5; echo a"), sandbox.commands.run("sleep 0.5; echo b")
        )
        assert [r.stdout for r in both] == ["a\n", "b\n"]
        assert (await slow.wait()).stdout == "slow\n"
    finally:
        await sandbox.kill()
    await asyncio.to_thread(face.assert_nothing_left)


# What a running command writes here: 8 MiB, in 1 MiB pieces of one digit each, then it waits.
WRITTEN = 8 << 20
SPACED_WRITER = (
    "for i in 1 2 3 4 5 6 7 8; do head -c 1048576 /dev/zero | tr '\\0' \"$i\"; sleep 0.05; done;"
    " sleep 60"
)


def test_a_running_commands_output_is_freed_in_the_sandbox_as_the_face_reads_it(
    face: Face, base_image: str
):
    # A process's output files are on the sandbox's /dev/shm (memory, 64 MiB in Docker by
    # default): what the face has read is punched out of them while the process runs on, and
    # the bytes the client gets stay exact.
    with held_sandbox(face, base_image) as sandbox:
        got: list[str] = []

        def write() -> None:  # the sync SDK calls on_stdout while it waits: in a thread
            with contextlib.suppress(CommandExitException):  # its end is the kill below
                sandbox.commands.run(SPACED_WRITER, on_stdout=got.append, timeout=120)

        writing = threading.Thread(target=write)
        writing.start()
        deadline = time.monotonic() + 60
        while sum(map(len, got)) < WRITTEN and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "".join(got) == "".join(str(i) * (1 << 20) for i in range(1, 9))
        [writer] = sandbox.commands.list()

        def held() -> int:  # bytes the writer's stdout file holds in memory (512 B blocks)
            stat = f"stat -c %b {RECORD_DIR}/*-{writer.pid}.out"
            return int(sandbox.commands.run(stat).stdout) * 512

        deadline = time.monotonic() + 10
        while held() >= 1 << 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert held() < 1 << 20
        # The file keeps its size (a hole reads as zeros): offsets stay true.
        size = sandbox.commands.run(f"stat -c %s {RECORD_DIR}/*-{writer.pid}.out").stdout
        assert int(size) == WRITTEN
        assert sandbox.commands.kill(writer.pid) is True
        writing.join(30)
        assert not writing.is_alive()


def test_a_running_command_ends_as_killed_when_every_process_in_the_sandbox_is_killed(
    face: Face, base_image: str
):
    # `kill -9 -1` takes the container down; the node starts it again (with an empty /dev/shm,
    # where the face kept the running command's files): the command ends as envd ends a
    # signal-killed process, and the sandbox runs the next command.
    with held_sandbox(face, base_image) as sandbox:
        sleeper = sandbox.commands.run("sleep 60", background=True)
        with contextlib.suppress(Exception):  # what kills the machinery has no report of its own
            sandbox.commands.run("kill -9 -1")
        began = time.monotonic()
        with pytest.raises(CommandExitException) as killed:
            sleeper.wait()
        assert (killed.value.exit_code, killed.value.error) == (-1, "signal: killed")
        assert time.monotonic() - began < QUICK_S
        assert sandbox.commands.run("echo again").stdout == "again\n"
        assert sandbox.commands.list() == []
