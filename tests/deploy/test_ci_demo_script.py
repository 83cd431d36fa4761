"""scripts/ci-demo runs scripts/demo as a newcomer would (issue 35): in a fresh venv with no
system site packages, first on PATH, and fails when the demo exits non-zero or prints a Python
traceback; .ci/run runs it beside the tests' last steps (after them, given pytest arguments)
and ends with its wall time.

The scripts run as written, in a copy of the checkout's folders, with a stand-in scripts/demo
(and scripts/test) that reports what it finds and ends as the test asks. The venv is real, made
by this interpreter's `venv` without pip (the stand-in demo installs nothing; seeding pip takes
seconds a run).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRACEBACK = "Traceback (most recent call last):"


def _script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _checkout(tmp_path: Path, demo_body: str) -> Path:
    checkout = tmp_path / "swerl"
    for rel in ("scripts/ci-demo", ".ci/run"):
        (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, checkout / rel)
    # The stand-in demo says which python it got and whether that one sees the machine's
    # packages (grpc is installed here, so only an isolated venv lacks it).
    _script(
        checkout / "scripts/demo",
        'echo "python: $(command -v python)"\n'
        "python -c 'import sys; print(\"venv:\", sys.prefix != sys.base_prefix)'\n"
        "python -c 'import grpc' 2>/dev/null && echo 'grpc: visible' || echo 'grpc: hidden'\n"
        'echo "args: $*"\n' + demo_body,
    )
    return checkout


def _run(checkout: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # SWERL_CI_DEMO_PYTHON runs as `<it> -m venv DIR`: this interpreter's venv, without pip.
    python = tmp_path / "python-for-venv"
    _script(python, f'exec {sys.executable} "$1" "$2" --without-pip "$3"\n')
    env = {**os.environ, "TMPDIR": str(tmp_path), "SWERL_CI_DEMO_PYTHON": str(python)}
    return _bash(checkout / "scripts/ci-demo", args, env, timeout_s=180)


def _bash(
    script: Path, args: tuple[str, ...], env: dict[str, str], *, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )


def test_the_demo_runs_in_a_fresh_venv_first_on_path(tmp_path):
    checkout = _checkout(tmp_path, "exit 0\n")
    run = _run(checkout, tmp_path, "--image", "x")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    (python,) = [line.removeprefix("python: ") for line in lines if line.startswith("python: ")]
    assert python.startswith(str(tmp_path / "swerl-ci-demo."))
    assert python.endswith("/venv/bin/python")
    assert "venv: True" in lines and "grpc: hidden" in lines
    assert "args: --image x" in lines
    assert lines[-1].startswith("[ci-demo] ok: scripts/demo exited 0 without a traceback in ")
    # The temporary venv is gone afterwards.
    assert not list(tmp_path.glob("swerl-ci-demo.*"))


def test_a_demo_that_exits_non_zero_fails_the_job(tmp_path):
    checkout = _checkout(tmp_path, "echo '[demo] pip install failed' >&2\nexit 3\n")
    run = _run(checkout, tmp_path)
    assert run.returncode == 1
    assert "[demo] pip install failed" in run.stderr  # the demo's stderr is shown as it comes
    assert run.stderr.splitlines()[-1].startswith("[ci-demo] FAILED: scripts/demo exited 3 after")


def test_a_traceback_fails_the_job_even_when_the_demo_exits_0(tmp_path):
    for stream in ("", ">&2"):
        checkout = _checkout(
            tmp_path / f"s{len(stream)}",
            f"echo '{TRACEBACK}' {stream}\necho 'ModuleNotFoundError: x' {stream}\nexit 0\n",
        )
        run = _run(checkout, tmp_path / f"s{len(stream)}")
        assert run.returncode == 1, (stream, run.stdout, run.stderr)
        assert TRACEBACK in run.stdout + run.stderr
        assert "[ci-demo] FAILED: scripts/demo printed a Python traceback" in run.stderr


def test_ci_runs_the_demo_beside_the_tests_tail_and_ends_with_its_wall_time(tmp_path):
    checkout = _checkout(tmp_path, "exit 0\n")
    # The stand-in scripts/test runs what SWERL_TEST_BESIDE_TAIL names, as the real one does
    # beside its last steps, and fails when that fails.
    _script(
        checkout / "scripts/test",
        'echo "tests: $* (beside: ${SWERL_TEST_BESIDE_TAIL:-none})"\n'
        'if [[ -n "${SWERL_TEST_BESIDE_TAIL:-}" ]]; then bash -c "$SWERL_TEST_BESIDE_TAIL"; fi\n',
    )
    _script(checkout / "scripts/ci-demo", 'echo "ci-demo ran"\n')
    # Not the value of the .ci/run that runs this suite (it sets the variable for scripts/test).
    env = {k: v for k, v in os.environ.items() if k != "SWERL_TEST_BESIDE_TAIL"}
    env["TMPDIR"] = str(tmp_path)

    def ci(*args: str) -> subprocess.CompletedProcess[str]:
        return _bash(checkout / ".ci/run", args, env, timeout_s=60)

    run = ci()
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines.index("tests:  (beside: scripts/ci-demo)") < lines.index("ci-demo ran")
    assert lines[-1].startswith("== .ci/run: ok; wall time 0 min ")
    # Given pytest arguments, scripts/test runs no tail: the demo runs after it.
    run = ci("-k", "x")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines.index("tests: -k x (beside: none)") < lines.index("ci-demo ran")
    assert lines[-1].startswith("== .ci/run: ok; wall time 0 min ")

    _script(checkout / "scripts/ci-demo", 'echo "ci-demo failed"\nexit 1\n')
    failed = ci()
    assert failed.returncode == 1
    assert failed.stdout.splitlines()[-1].startswith(
        "== .ci/run: FAILED in scripts/test (rc 1); wall time 0 min "
    )
    _script(checkout / "scripts/test", "exit 4\n")
    for args in ((), ("-k", "x")):
        failed = ci(*args)
        assert failed.returncode == 4
        assert "ci-demo" not in failed.stdout
        last = failed.stdout.splitlines()[-1]
        assert last.startswith("== .ci/run: FAILED in scripts/test (rc 4); wall time 0 min ")
