"""Commands in a sandbox through one long-lived shell instead of one `docker exec` each.

Every sandbox has an I/O directory on the node, bind-mounted into the container at /.swerl-io.
A `Supervisor` is a `bash --login -s` inside the container whose stdin, stdout and stderr are
FIFOs in that directory, fed `supervisor.sh`. Each command is one line of bash written to it;
its output comes back on the FIFOs directly (dockerd is not on the data path), framed on stdout by
NUL-delimited markers carrying a per-supervisor token. A round trip costs about a millisecond
instead of the ~60 ms of a `docker exec`. The protocol, with the state tables of both sides, is
docs/shell-protocol.md (rows N1-N15 there are this package's side).

`SandboxShell` owns the supervisor of one sandbox and the shell's turn: one command at a time,
callers queued in arrival order. A `CommandRun` is one command: the FIFO readers feed it from
event-loop callbacks into a queue the caller consumes (reading pauses while the caller lags), so
a caller that goes away (cancelled RPC) only marks the run abandoned: the command's process group
is killed and the supervisor is back in step for the next command, or replaced if it is not.

The package, one module per part: `wire` (quoting, framing, markers, FIFOs), `spec` (a command
and its events), `supervisor` (the shell process and its FIFO readers), `session` (SandboxShell)
and `run` (CommandRun, which knows its session only as the `RunShell` protocol).
"""

from __future__ import annotations

from swerl.exec.outcome import Exit
from swerl.exec.shell.run import (
    BACKSTOP_GRACE_S,
    GIVE_UP_S,
    PAUSE_AT,
    RESUME_AT,
    RESYNC_S,
    CommandRun,
    RunShell,
)
from swerl.exec.shell.session import MAX_RESTARTS, RESTART_WINDOW_S, SandboxShell
from swerl.exec.shell.spec import SIGNALS, CommandSpec, Event, Output, Started
from swerl.exec.shell.supervisor import READ_CHUNK, READY_TIMEOUT_S, SUPERVISOR_SCRIPT, Supervisor
from swerl.exec.shell.wire import (
    CONTAINER_IO_DIR,
    MAX_TIMEOUT_S,
    MarkerScanner,
    bash_quote,
    ensure_io_dir,
    env_script,
    frame,
)

__all__ = [
    "BACKSTOP_GRACE_S",
    "CONTAINER_IO_DIR",
    "GIVE_UP_S",
    "MAX_RESTARTS",
    "MAX_TIMEOUT_S",
    "PAUSE_AT",
    "READY_TIMEOUT_S",
    "READ_CHUNK",
    "RESTART_WINDOW_S",
    "RESUME_AT",
    "RESYNC_S",
    "SIGNALS",
    "SUPERVISOR_SCRIPT",
    "CommandRun",
    "CommandSpec",
    "Event",
    "Exit",
    "MarkerScanner",
    "Output",
    "RunShell",
    "SandboxShell",
    "Started",
    "Supervisor",
    "bash_quote",
    "ensure_io_dir",
    "env_script",
    "frame",
]
