"""The face's process scripts (swerl.e2b.scripts) run by real bash in the base image: a quick
command's launch reads its output back exact, a poll never takes a status file caught between
its creation and its write, and the cleanup removes every file a process had."""

from __future__ import annotations

import subprocess

import pytest

from swerl.e2b.scripts import (
    RECORD_DIR,
    cleanup_command,
    files,
    job_spec,
    launch_command,
    poll_command,
)

pytestmark = pytest.mark.docker

REC = "t1-1000"


def in_sandbox(base_image: str, script: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["docker", "run", "--rm", base_image, "bash", "-c", script],
        capture_output=True,
        timeout=120,
        check=False,
    )


def test_a_quick_launch_reports_exact_bytes_and_the_cleanup_removes_its_files(base_image: str):
    job = job_spec("/bin/bash", ["-l", "-c", "printf 'a\\0b\\0\\0c\\n'; printf 'e\\n' >&2"], None)
    f = files(REC)
    script = (
        f"{{ {launch_command(job, REC, False, 1 << 20)}; }} >/tmp/report.out 2>/tmp/report.err; "
        f"cat /tmp/report.out; printf '|%s|' \"$(cat /tmp/report.err)\"; "
        f"ls {f}.* | tr '\\n' ' '; printf '|'; {cleanup_command([REC])}; "
        f"ls {f}.* 2>/dev/null | wc -l"
    )
    done = in_sandbox(base_image, script)
    report, err, listed, left = done.stdout.split(b"|")
    assert report == b"E 0\na\0b\0\0c\n"
    assert err == b"e"
    # Nothing is removed on the launch's own path; the cleanup takes all of it.
    assert sorted(listed.split()) == sorted(
        f"{f}{s}".encode() for s in (".err", ".out", ".pgid", ".rc")
    )
    assert left.strip() == b"0"


def test_a_poll_does_not_take_a_status_file_still_empty(base_image: str):
    f = files(REC)
    poll = poll_command(REC, 0, 0, 1 << 20, [])
    script = (
        f"mkdir -p {RECORD_DIR}; echo $$ >{f}.pgid; "  # its group's shell: this one, alive
        f"printf 'out' >{f}.out; : >{f}.err; : >{f}.rc; {{ {poll}; }}; printf '|'; "
        f"echo 5 >{f}.rc; {{ {poll}; }}"
    )
    done = in_sandbox(base_image, script)
    assert done.stdout == b"R\nout|E 5\nout"
