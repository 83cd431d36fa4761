"""The inspector's evaluation section says why a patch was not graded or was graded as it was: the
report's error (git's complaint for a patch that did not apply), the test command's exit code,
the network the evaluation had and its warnings (an install step or a network step that failed,
issue 17), all from the episode's meta.json as the agent writes it."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.request import urlopen

import pytest
from testkit.web import Served


def _episode(run: Path, key: str, report: dict) -> None:
    folder = run / key
    folder.mkdir(parents=True)
    meta = {
        "episode_id": key.split("__")[1],
        "instance_id": key.split("__")[0],
        "status": "SUBMITTED",
        "reward": -1.0,
        "metrics": {"turns": 1},
        "report": report,
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    traj = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "p"}]}
    (folder / "traj.json").write_text(json.dumps({**traj, "steps": []}))


@pytest.fixture(scope="module")
def inspector(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    # As MessageToDict writes an EvaluationReport (camelCase keys, enum names, no defaults).
    _episode(
        run,
        "a__offline",
        {
            "status": "EVALUATION_STATUS_UNRESOLVED",
            "patchApplied": True,
            "applyMethod": "APPLY_METHOD_GIT_APPLY",
            "testExitCode": 1,
            "network": "NETWORK_MODE_NONE",
            "warnings": [
                {
                    "reason": "NETWORK_STEP_FAILED",
                    "message": "a step needed the network and ran without network: "
                    "Temporary failure in name resolution",
                }
            ],
        },
    )
    _episode(
        run,
        "b__noapply",
        {
            "status": "EVALUATION_STATUS_PATCH_FAILED",
            "testExitCode": -1,
            "network": "NETWORK_MODE_BRIDGE",
            "packageIndex": "http://mirror.example/simple",
            "errorReason": "PATCH_APPLY_FAILED",
            "errorMessage": "error: listutils/x.py: No such file or directory",
        },
    )
    served = Served("inspect", str(run), "--port", "0", "--tokenizer", "")
    yield served
    served.stop()


def _page(inspector, key: str) -> str:
    with urlopen(f"{inspector.url}/episode/{key}", timeout=30) as response:
        return response.read().decode()


def test_the_evaluation_shows_its_network_exit_code_and_warnings(inspector):
    page = _page(inspector, "a__offline")
    assert '<span id="test-exit-code">1</span>' in page
    assert '<span id="eval-network">NONE</span>' in page
    assert "(GIT_APPLY)" in page
    assert "<strong>NETWORK_STEP_FAILED</strong>" in page
    assert "Temporary failure in name resolution" in page
    assert 'id="eval-error"' not in page


def test_a_patch_that_did_not_apply_shows_the_reason_and_gits_complaint(inspector):
    page = _page(inspector, "b__noapply")
    assert 'id="eval-error"' in page and "PATCH_APPLY_FAILED" in page
    assert "listutils/x.py: No such file or directory" in page
    assert '<span id="test-exit-code">-1</span>' in page
    assert '<span id="eval-network">BRIDGE</span>' in page
    assert "package index http://mirror.example/simple" in page
    assert 'id="eval-warnings"' not in page
