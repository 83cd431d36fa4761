"""What a command is (`CommandSpec`) and what comes back from it (`Started`, `Output`, `Exit`,
the last defined with the client's result in swerl.exec.outcome)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from swerl.exec.outcome import Exit

# The signals a caller can send a running command (names for `kill -s`).
SIGNALS = ("INT", "TERM", "KILL")


@dataclass(frozen=True)
class CommandSpec:
    command: str
    cwd: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    # Zero: the node's default (ExecSettings), filled in by swerl.exec.commands.with_node_defaults
    # before a command reaches the shell.
    timeout_s: float = 0.0
    max_output_bytes: int = 0
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


Event = Started | Output | Exit
