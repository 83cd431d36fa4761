"""The `swerl` command prints swerl's own lines only: no advice from transformers that PyTorch is
absent, no grpc core log lines (e.g. a GOAWAY when an in-process stack stops), unless the user
asked for them with their own GRPC_VERBOSITY / TRANSFORMERS_NO_ADVISORY_WARNINGS."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from swerl.chassis.logging import QUIET_ENV, quiet_foreign_libraries
from swerl.tasks import default_tasks_dir

FOREIGN = ("PyTorch was not found", "[transformers]", "GOAWAY", "chttp2_transport")


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def environment_without_quiet_settings() -> dict[str, str]:
    """The caller's environment as a fresh shell has it: none of the quiet defaults set."""
    return {k: v for k, v in os.environ.items() if k not in QUIET_ENV}


def test_eval_with_the_replay_policy_prints_no_foreign_library_lines(tmp_path):
    # The replay policy loads the Qwen3 tokenizer through transformers; the run talks gRPC to an
    # agent address nobody serves, so every episode is an infra error and nothing needs Docker.
    result = subprocess.run(
        [
            *(sys.executable, "-m", "swerl.cli", "eval", str(default_tasks_dir())),
            *("--replay", "gold", "--no-build", "-o", str(tmp_path / "out")),
            *("--agent", f"127.0.0.1:{_closed_port()}"),
            *("--instance-ids", "swerl-examples__romans-5"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment_without_quiet_settings(),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "errors 1" in result.stdout, output  # it ran
    assert not [line for line in output.splitlines() if any(f in line for f in FOREIGN)]


def test_the_users_own_settings_win():
    environ = {"GRPC_VERBOSITY": "DEBUG"}
    quiet_foreign_libraries(environ)
    assert environ == {"GRPC_VERBOSITY": "DEBUG", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
