"""`swerl replay serve`'s own bad input: a harness it has no scripts for is refused at once, with
the harnesses it knows (the soak starts one server per harness it plays)."""

from __future__ import annotations

import subprocess
import sys


def test_replay_serve_refuses_a_harness_it_has_no_scripts_for():
    done = subprocess.run(
        [sys.executable, "-m", "swerl.cli", "replay", "serve", "--harness", "no-such-harness"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--harness 'no-such-harness' is not one of claude-code, mini-swe-agent" in done.stderr
