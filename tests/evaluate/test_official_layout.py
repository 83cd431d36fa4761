"""Classic SWE-bench rows on an image in the official layout (testkit.official), end to end.

The row has no eval_script, so Evaluate runs swebench's own eval.sh: it activates the `testbed`
environment through the conda shim, tries `pip install -e .` (there is no pip offline, as there
is no index offline for a real image), applies the test patch and runs `pytest -rA`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import docker
import pytest
from testkit.evaluate import evaluate
from testkit.official import write_official_task

from swerl.cli import main
from swerl.exec.client import SandboxClient
from swerl.exec.evaluate import build_eval_spec
from swerl.exec.v1 import evaluate_pb2 as pb
from swerl.exec.v1 import sandbox_pb2
from swerl.tasks import TaskImageError, build_images

pytestmark = pytest.mark.docker


def _tests(report: pb.EvaluationReport) -> tuple[list[str], ...]:
    return (
        sorted(report.fail_to_pass.success),
        sorted(report.fail_to_pass.failure),
        sorted(report.pass_to_pass.success),
        sorted(report.pass_to_pass.failure),
    )


async def test_gold_patch_resolves_the_classic_row_with_the_tests_exit_code(
    eval_node, official_task
):
    evaluation = await evaluate(
        eval_node.evaluate, official_task.instance, official_task.gold_patch
    )
    report = evaluation.report
    assert evaluation.status == "RESOLVED_FULL", report
    assert report.test_exit_code == 0
    # swebench's script applies the test patch itself and prints its own markers once.
    assert "APPLY_TEST_PATCH" not in evaluation.phases
    log = evaluation.log_of("RUN_TESTS")
    assert log.count(b">>>>> Start Test Output") == 1
    # The shim activated the testbed environment: pytest ran from it.
    assert b"/opt/miniconda3/envs/testbed/bin/python" in log or b"conda activate testbed" in log


async def test_failing_tests_give_their_exit_code_not_the_scripts_last_command(
    eval_node, official_task
):
    # No fix: FAIL_TO_PASS fails, pytest exits 1. The script's last step (restoring the test
    # files with git checkout) exits 0; the report must carry pytest's 1.
    harmless = (
        "diff --git a/NOTES b/NOTES\nnew file mode 100644\n--- /dev/null\n+++ b/NOTES\n"
        "@@ -0,0 +1 @@\n+unrelated\n"
    )
    evaluation = await evaluate(eval_node.evaluate, official_task.instance, harmless)
    assert evaluation.status == "UNRESOLVED"
    assert evaluation.report.test_exit_code == 1
    assert set(evaluation.report.fail_to_pass.failure) == set(official_task.fail_to_pass)


async def test_offline_install_step_failure_is_a_warning_and_the_network_is_reported(
    eval_node, official_task
):
    report = (
        await evaluate(eval_node.evaluate, official_task.instance, official_task.gold_patch)
    ).report
    assert report.network == sandbox_pb2.NETWORK_MODE_NONE
    reasons = [warning.reason for warning in report.warnings]
    assert reasons == ["INSTALL_STEP_FAILED"], report.warnings
    assert "pip install -e ." in report.warnings[0].message
    assert report.status == pb.EVALUATION_STATUS_RESOLVED_FULL  # a warning, not a verdict


@pytest.mark.parametrize("patch_kind", ["gold", "none"])
async def test_swebenchs_own_script_pasted_as_eval_script_grades_like_the_classic_path(
    eval_node, official_task, patch_kind
):
    patch = (
        official_task.gold_patch
        if patch_kind == "gold"
        else official_task.wrong_patch
        or (
            "diff --git a/NOTES b/NOTES\nnew file mode 100644\n--- /dev/null\n+++ b/NOTES\n"
            "@@ -0,0 +1 @@\n+unrelated\n"
        )
    )
    classic = await evaluate(eval_node.evaluate, official_task.instance, patch)
    pasted_row = dict(official_task.instance)
    pasted_row["eval_script"] = build_eval_spec(official_task.instance).eval_script
    pasted = await evaluate(eval_node.evaluate, pasted_row, patch)
    assert pasted.status == classic.status
    assert _tests(pasted.report) == _tests(classic.report)
    assert pasted.report.test_exit_code == classic.report.test_exit_code
    # Framed once: the pasted script's markers are the only ones in the log.
    assert pasted.log_of("RUN_TESTS").count(b">>>>> Start Test Output") == 1


WHERE_PYTHON = "command -v python || echo none; python -c 'import romans; print(romans.__file__)'"


async def test_agent_commands_resolve_python_to_the_testbed_environment(eval_node, official_task):
    # As the agent runs its commands: Exec on a sandbox of the image, through the exec node's
    # login shell, which reads /root/.bashrc as SWE-bench's images expect (they activate
    # `testbed` there, not on the image's PATH). Each mode, each command.
    created = await eval_node.sandboxes.CreateSandbox(
        sandbox_pb2.CreateSandboxRequest(
            request_id=uuid.uuid4().hex, image=official_task.image_name, workdir="/testbed"
        ),
        timeout=60,
    )
    sandbox_id = created.sandbox.sandbox_id
    client = SandboxClient(eval_node.channel)
    try:
        for session in (False, True, False):
            result = await client.run(sandbox_id, WHERE_PYTHON, session=session)
            assert result.exit_code == 0, result
            assert result.stdout.decode().split() == [
                "/opt/miniconda3/envs/testbed/bin/python",
                "/testbed/romans/__init__.py",
            ]
    finally:
        await client.aclose()
        await eval_node.sandboxes.DestroySandbox(
            sandbox_pb2.DestroySandboxRequest(request_id=uuid.uuid4().hex, sandbox_id=sandbox_id),
            timeout=60,
        )


def test_the_fixture_activates_testbed_in_bashrc_only_as_the_official_images_do(official_task):
    # A shell that reads no startup file does not see `testbed` (python is not on the image's
    # PATH at all): what the test above sees comes from the shell the exec node starts.
    client = docker.from_env()
    try:
        out = client.containers.run(
            official_task.image_name,
            ["bash", "-c", "command -v python || echo none; tail -n 1 /root/.bashrc"],
            network_disabled=True,
            remove=True,
        )
    finally:
        client.close()
    assert out.decode().splitlines() == [
        "none",
        "source /opt/miniconda3/etc/profile.d/conda.sh && conda activate testbed",
    ]


def test_validate_runs_the_three_checks_on_the_classic_row(official_task, capsys):
    root = official_task.directory.parent
    assert main(["validate", "--tasks", str(root), "--no-build"]) == 0
    out = capsys.readouterr().out
    assert "unpatched tree as the task says 1/1" in out
    assert "gold resolved 1/1" in out
    assert "correctly not resolved 1/1" in out


def test_validate_reports_the_classic_row_broken_when_fail_to_pass_already_passes(
    official_task, tmp_path, capsys
):
    # The same row (and image) with a FAIL_TO_PASS test that passes before any fix: a broken
    # task, told by the unpatched-tree check, whatever the gold patch does.
    already_passing = official_task.pass_to_pass[0]
    task = write_official_task(
        tmp_path,
        FAIL_TO_PASS=json.dumps([already_passing]),
        PASS_TO_PASS=json.dumps(official_task.pass_to_pass[1:]),
    )
    assert task.image_name == official_task.image_name
    assert main(["validate", "--tasks", str(tmp_path), "--no-build"]) == 1
    out = capsys.readouterr().out
    assert "unpatched tree as the task says 0/1" in out
    assert (
        f"broken task {task.instance_id}: FAIL_TO_PASS passing unpatched: {already_passing}" in out
    )


def test_an_image_at_an_unrelated_commit_fails_the_base_commit_check(
    official_task, base_image, tmp_path
):
    task = write_official_task(tmp_path, base_commit="1" * 40, image_name=official_task.image_name)
    with pytest.raises(TaskImageError) as info:
        build_images([task], base_image=base_image, progress=lambda _line: None)
    message = str(info.value)
    assert "neither base_commit " + "1" * 40 in message and "\n" not in message


def test_tasks_build_builds_the_classic_row_and_checks_its_base_commit(official_task, capsys):
    root = official_task.directory.parent
    # --rebuild runs the Dockerfile (from the build cache) and the base-commit check again.
    assert main(["tasks", "build", "--tasks", str(root), "--rebuild"]) == 0
    assert f"{official_task.image_name}: built in" in capsys.readouterr().out


FOREIGN = ("PyTorch was not found", "GOAWAY", "chttp2_transport")


def test_eval_runs_the_classic_row_end_to_end_and_prints_only_its_own_lines(
    official_task, tmp_path
):
    # As a user runs it: the replay policy's gold patch through pool, exec node and agent in
    # process, graded by swebench's own script; without the quiet defaults in the environment,
    # so that the command's own (transformers in the tokenizer workers, grpc when the stack
    # stops with calls open) are what keep foreign lines out.
    root = official_task.directory.parent
    out = tmp_path / "run"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GRPC_VERBOSITY", "TRANSFORMERS_NO_ADVISORY_WARNINGS")
    }
    result = subprocess.run(
        [
            *(sys.executable, "-m", "swerl.cli", "eval", str(root)),
            *("--replay", "gold", "--no-build", "-o", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    (record,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert record["instance_id"] == official_task.instance_id
    assert record["eval_status"] == "RESOLVED_FULL" and record["reward"] == 1.0
    # how it was graded: offline, and swebench's `pip install -e .` found no index
    assert record["eval_network"] == "NONE"
    warned = {w["reason"] for w in record["eval_warnings"]}
    assert warned & {"INSTALL_STEP_FAILED", "NETWORK_STEP_FAILED"}, record["eval_warnings"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["by_eval_network"] == {"NONE": 1}
    assert summary["instances_with_eval_warnings"] == [official_task.instance_id]
    assert not [line for line in output.splitlines() if any(f in line for f in FOREIGN)]
