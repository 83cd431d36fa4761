"""Processes killed from inside the sandbox (SIGKILL: no EXIT trap, so no status file) end
through the real E2B SDK as on E2B, whose envd reports a signal-killed process as exit code -1,
`exited` false, status and error `signal: killed`: `commands.run` raises CommandExitException
with that exit code and error, a handle's `wait()` returns instead of waiting forever, and a
normal exit is never taken for a kill."""

from __future__ import annotations

import time

import pytest
from e2b import CommandExitException, Sandbox

pytestmark = pytest.mark.docker

# Far more than a killed process takes to be told (a poll interval, at most 200 ms), far less
# than "forever": a killed process that is never told hangs its wait.
ENDS_WITHIN_S = 10.0


def test_a_command_that_kills_its_own_shell_ends_as_killed(sandbox: Sandbox):
    began = time.monotonic()
    with pytest.raises(CommandExitException) as killed:
        sandbox.commands.run("echo before; kill -9 $$; echo after", timeout=ENDS_WITHIN_S)
    assert (killed.value.exit_code, killed.value.error) == (-1, "signal: killed")
    assert (killed.value.stdout, killed.value.stderr) == ("before\n", "")
    assert time.monotonic() - began < ENDS_WITHIN_S
    # `$$` was the command's own shell, not the node's: the sandbox runs on, and `$$` differs
    # between two commands.
    first, second = (sandbox.commands.run("echo $$").stdout for _ in range(2))
    assert first != second
    assert sandbox.commands.run("echo still here").stdout == "still here\n"


def test_a_background_command_whose_group_is_killed_from_another_ends(sandbox: Sandbox):
    handle = sandbox.commands.run(
        "echo started; ps -o pgid= -p $BASHPID | tr -d ' ' >/tmp/pgid.new;"
        " mv /tmp/pgid.new /tmp/pgid; sleep 60",
        background=True,
    )
    sandbox.commands.run("until [ -s /tmp/pgid ]; do sleep 0.05; done; kill -9 -- -$(</tmp/pgid)")
    began = time.monotonic()
    with pytest.raises(CommandExitException) as killed:
        handle.wait()
    assert time.monotonic() - began < ENDS_WITHIN_S
    assert (killed.value.exit_code, killed.value.error) == (-1, "signal: killed")
    assert killed.value.stdout == "started\n"
    assert sandbox.commands.list() == []

    # One with stdin open (a holder of its stdin FIFO in its group) ends too, holder and all.
    reader = sandbox.commands.run(
        "read -r line; ps -o pgid= -p $BASHPID | tr -d ' ' >/tmp/reader; kill -9 $BASHPID",
        background=True,
        stdin=True,
    )
    sandbox.commands.send_stdin(reader.pid, "go\n")
    began = time.monotonic()
    with pytest.raises(CommandExitException) as killed:
        reader.wait()
    assert time.monotonic() - began < ENDS_WITHIN_S
    assert (killed.value.exit_code, killed.value.error) == (-1, "signal: killed")
    assert sandbox.commands.run("pgrep -g $(</tmp/reader) || echo none").stdout == "none\n"


def test_quick_exits_beside_kills_each_get_their_exact_end(sandbox: Sandbox):
    # Quick ones end within the launch's grace, the slower ones (past 100 ms) on a poll, where
    # the check for a killed process runs: each still ends with its own exit code, never as
    # killed, and the killed ones between them as killed.
    for n in range(20):
        source = "exit 3" if n % 2 else "sleep 0.15; exit 3"
        with pytest.raises(CommandExitException) as exited:
            sandbox.commands.run(f"echo {n}; {source}", timeout=ENDS_WITHIN_S)
        assert (exited.value.exit_code, exited.value.stdout) == (3, f"{n}\n")
        assert sandbox.commands.run(f"sleep 0.{n % 3}; echo ok").stdout == "ok\n"
        if n % 5 == 0:
            with pytest.raises(CommandExitException) as killed:
                sandbox.commands.run("sleep 0.15; kill -9 $BASHPID", timeout=ENDS_WITHIN_S)
            assert (killed.value.exit_code, killed.value.error) == (-1, "signal: killed")
