"""How a command ended: `Exit` as the node reports it, `ExecResult` as a client gathers it.

The node streams a command's output as it comes and ends with one `Exit`; a client that waits
for the whole command (`swerl.exec.client`) gets an `ExecResult`, which is that same `Exit` with
the output it gathered. One definition of the exit's fields serves both sides of the wire.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
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


@dataclass(frozen=True, kw_only=True)
class ExecResult(Exit):
    """A finished command with all of its output (stdout and stderr kept apart)."""

    stdout: bytes
    stderr: bytes

    @property
    def output(self) -> bytes:
        """stdout then stderr (the order of interleaving is not kept across streams)."""
        return self.stdout + self.stderr
