"""A task in the official SWE-bench layout, built offline from a bundled task, as a classic row.

SWE-bench's published images cannot be pulled here, so the tests make one of their own shape:
the bundled task's repository at its base commit, a `testbed` environment under /opt/miniconda3
behind a `conda` shim (official_layout/), and one environment-setup commit above base_commit.
The row is a classic SWE-bench row: no eval_script, test lists as JSON text, no image_name (the
loader names the image by SWE-bench's rule), and `repo`/`version` that swebench knows, so
Evaluate runs swebench's own eval.sh for it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from swerl.tasks import TaskInstance, load_task
from testkit.evaluate import TASKS

SOURCE_TASK = "swerl-examples__romans-5"
INSTANCE_ID = "swerl-official__romans-5"
# A repository and version swebench has an eval spec for: its test command is `pytest -rA`
# on the test patch's files, after `python -m pip install -e .`.
SWEBENCH_REPO, SWEBENCH_VERSION = "pytest-dev/pytest", "7.4"
LAYOUT_DIR = Path(__file__).resolve().parent / "official_layout"


def classic_row(task: TaskInstance, instance_id: str = INSTANCE_ID) -> dict[str, Any]:
    """The bundled task's row as SWE-bench publishes rows."""
    row = {
        key: value
        for key, value in task.instance.items()
        if key not in ("eval_script", "eval_type", "log_parser", "image_name")
    }
    row.update(
        instance_id=instance_id,
        repo=SWEBENCH_REPO,
        version=SWEBENCH_VERSION,
        FAIL_TO_PASS=json.dumps(task.fail_to_pass),
        PASS_TO_PASS=json.dumps(task.pass_to_pass),
    )
    return row


def write_official_task(root: Path, **changes: Any) -> TaskInstance:
    """Writes the classic task directory under `root` (row `changes` applied) and loads it."""
    source = TASKS[SOURCE_TASK]
    directory = root / INSTANCE_ID
    shutil.copytree(source.directory / "repo", directory / "repo")
    for name in ("gold.patch", "test.patch"):
        shutil.copy(source.directory / name, directory / name)
    shutil.copy(LAYOUT_DIR / "activate", directory / "activate")
    dockerfile = source.dockerfile.read_text() + (LAYOUT_DIR / "Dockerfile.layout").read_text()
    (directory / "Dockerfile").write_text(dockerfile)
    row = classic_row(source)
    row.update(changes)
    (directory / "instance.json").write_text(json.dumps(row, indent=2))
    return load_task(directory)
