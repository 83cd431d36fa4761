"""mini-swe-agent's Environment protocol over a swerl sandbox: what the mini-swe-agent harness
(`swerl.agent.harnesses.mini_swe_agent`) and the evaluation's `SwerlEnvironment`
(`swerl.evaluation.mini_swe_agent`, leasing its own sandbox from the pool) share.

A subclass says how one command runs (`_exec`: an Exec of the sandbox, stdout and stderr merged
in order by the shell); this class shapes the result the way mini-swe-agent's own environments
do (`output`, `returncode`, `exception_info`; a timeout is returncode -1 with the exception's
text) and detects a submission by mini-swe-agent's rule (first output line
`COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`, exit code 0), raised as its `Submitted`.

mini-swe-agent is imported only when a method needs it (it is optional for the agent service).
"""

from __future__ import annotations

import platform
from typing import Any, ClassVar

from swerl.exec.outcome import ExecResult

SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

# Prepended to every command: stderr joins stdout in the shell, so the model sees both
# interleaved as they happened (as mini-swe-agent's Docker environment returns them).
MERGE_STDERR = "exec 2>&1\n"


class SandboxEnvironmentBase:
    """The Environment protocol (execute, get_template_vars, serialize) over `_exec`."""

    # Failures of `_exec` the model is shown as the command's error (mini-swe-agent's own
    # environments do so); anything else propagates and ends the agent's run.
    shown_errors: ClassVar[tuple[type[BaseException], ...]] = (Exception,)
    # Config fields kept out of templates and serialized trajectories.
    secret_fields: ClassVar[set[str]] = set()
    config: Any  # a pydantic model with at least `cwd` and `timeout`

    def _exec(self, command: str, cwd: str, timeout_s: float) -> ExecResult:
        """Runs one command (MERGE_STDERR already prepended) in the sandbox."""
        raise NotImplementedError

    def _serialized_extra(self) -> dict[str, Any]:
        """Extra `info.config` entries of `serialize` (the lease, the node)."""
        return {}

    # -- mini-swe-agent's protocol ---------------------------------------------------------
    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        command = action.get("command", "")
        limit = timeout or self.config.timeout
        try:
            result = self._exec(MERGE_STDERR + command, cwd or self.config.cwd, float(limit))
        except self.shown_errors as exc:
            output: dict[str, Any] = {
                "output": "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {exc}",
                "extra": {"exception_type": type(exc).__name__, "exception": str(exc)},
            }
        else:
            text = result.stdout.decode("utf-8", "replace")
            output = {"output": text, "returncode": result.exit_code, "exception_info": ""}
            if result.timed_out:
                output["returncode"] = -1
                output["exception_info"] = (
                    f"An error occurred while executing the command: timed out after {limit} s"
                )
                output["extra"] = {"exception_type": "TimeoutExpired", "exception": "timed out"}
        self._check_finished(output)
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        from minisweagent.utils.serialize import recursive_merge

        values = self.config.model_dump(exclude=self.secret_fields)
        return recursive_merge(values, platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json", exclude=self.secret_fields),
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                    **self._serialized_extra(),
                }
            }
        }

    def _check_finished(self, output: dict) -> None:
        from minisweagent.exceptions import Submitted

        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_SENTINEL and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )
