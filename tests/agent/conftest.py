import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session", autouse=True)
def _no_sandboxes_of_an_earlier_run():
    """Removes the sandboxes an earlier, killed run of these tests left on this dockerd (their
    nodes are gone, so no one else would): the tests' no-sandbox-left checks count every
    agent-test sandbox. One run of the agent tests at a time per dockerd."""
    listed = subprocess.run(
        [
            "docker",
            "ps",
            "-a",
            "--filter",
            "label=swerl.node",
            "--format",
            '{{.ID}} {{.Label "swerl.node"}}',
        ],
        capture_output=True,
        text=True,
    )
    stale = [
        row.split()[0]
        for row in listed.stdout.splitlines()
        if len(row.split()) == 2 and row.split()[1].startswith("agent-test")
    ]
    if listed.returncode == 0 and stale:
        subprocess.run(["docker", "rm", "-f", *stale], capture_output=True)
