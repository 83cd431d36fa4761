"""What a command is (`CommandSpec`) and what comes back from it (`Started`, `Output`, `Exit`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# The signals a caller can send a running command (names for `kill -s`).
SIGNALS = ("INT", "TERM", "KILL")


@dataclass(frozen=True)
class CommandSpec:
    command: str
    cwd: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 180.0
    max_output_bytes: int = 1 << 20
    session: bool = False
    open_stdin: bool = False
    notify_started: bool = False


@dataclass(frozen=True)
class Started:
    pgid: int


@dataclass(frozen=True)
class Output:
    stream: int  # STDOUT | STDERR
    data: bytes


@dataclass(frozen=True)
class Exit:
    exit_code: int
    timed_out: bool
    output_truncated: bool
    bytes_dropped: int
    duration_s: float
    signaled: bool
    # The sandbox's container had stopped (a command killed every process) and was started
    # again, filesystem intact, before this command ran.
    sandbox_restarted: bool = False


Event = Started | Output | Exit
