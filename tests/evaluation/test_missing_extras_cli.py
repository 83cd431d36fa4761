"""`swerl eval --harness mini-swe-agent` and `swerl demo` on a machine without mini-swe-agent (or
the demo's other packages): each checks before it starts anything, prints one line saying what to
install, and exits 2 with no traceback. Real subprocesses, the packages hidden from their start
(testkit.hidden), dockerd out of reach: whatever ran past the check would fail on it."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from testkit.hidden import hide_here, hiding_env

from swerl.tasks import default_tasks_dir

NO_DOCKER = "unix:///nonexistent/docker.sock"


def _swerl(tmp_path: Path, hidden: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swerl.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=hiding_env(tmp_path / "site", hidden, DOCKER_HOST=NO_DOCKER),
    )


def test_eval_with_a_harness_whose_package_is_missing_says_what_to_install(tmp_path):
    out = tmp_path / "out"
    run = _swerl(
        tmp_path,
        ["minisweagent"],
        "eval",
        str(default_tasks_dir()),
        "--replay",
        "gold",
        "--harness",
        "mini-swe-agent",
        "-o",
        str(out),
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [
        "swerl eval: harness 'mini-swe-agent' needs mini-swe-agent (import minisweagent), not"
        " installed here: pip install 'swerl[harness]'"
    ]
    assert "Traceback" not in run.stderr
    # Nothing started: no instance selected, no output folder, so no stack and no lease.
    assert run.stdout == ""
    assert not out.exists()


def test_eval_leaves_the_check_to_a_remote_agent(monkeypatch):
    # The local process's packages say nothing about the remote agent's host.
    from swerl.evaluation.cli import _harness_problem

    hide_here(monkeypatch, ["minisweagent"])
    local = argparse.Namespace(agent="", harness="mini-swe-agent")
    assert _harness_problem(local) is not None
    remote = argparse.Namespace(agent="agent.example:50053", harness="mini-swe-agent")
    assert _harness_problem(remote) is None


def test_demo_without_its_packages_says_what_to_install(tmp_path):
    run = _swerl(tmp_path, ["minisweagent", "openai"], "demo")
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [
        "swerl demo: needs openai (import openai), mini-swe-agent (import minisweagent), not"
        " installed here: pip install 'swerl[demo]' (scripts/demo installs it)"
    ]
    assert run.stdout == ""  # the tour did not start: no exec node line
