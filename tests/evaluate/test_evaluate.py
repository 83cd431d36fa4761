"""EvaluateService end to end: the real gRPC service on an in-process node over the real dockerd,
grading the bundled tasks' patches (gold, empty, wrong, malformed, fuzzy, huge), their eval
scripts (heredocs, hangs, exit codes), and refusing bad eval specs with a status and a reason.
"""

from __future__ import annotations

import uuid

import grpc
import pytest
from testkit.evaluate import (
    TASK_IDS,
    TASKS,
    evaluate,
    evaluate_failure,
    task_instance,
)
from testkit.exec import assert_status

from swerl.exec.client import SandboxClient
from swerl.exec.v1 import sandbox_pb2

LISTUTILS = "swerl-examples__listutils-14"
SEMVERLITE = "swerl-examples__semverlite-41"
PHASES = ["PREPARE", "APPLY_PATCH", "APPLY_TEST_PATCH", "RUN_TESTS", "GRADE"]
# A patch every bundled repository accepts but that fixes nothing: it only adds a file.
HARMLESS_PATCH = """\
diff --git a/NOTES.md b/NOTES.md
new file mode 100644
--- /dev/null
+++ b/NOTES.md
@@ -0,0 +1 @@
+A note that changes no behaviour.
"""


def _drift_first_context_line(patch: str) -> str:
    """The patch with the first context line of its first hunk changed, as if the file had
    drifted since the patch was made: exact `git apply` (and --3way, --reject) refuse it,
    `patch --fuzz` ignores that line and applies the rest."""
    lines = patch.split("\n")
    in_hunk = False
    for number, line in enumerate(lines):
        if line.startswith("@@"):
            in_hunk = True
        elif in_hunk and line.startswith(" ") and line.strip():
            lines[number] = line + "  # drifted"
            return "\n".join(lines)
    raise AssertionError("the patch has no context line to drift")


# -- gold, empty and wrong patches ---------------------------------------------------------------
@pytest.mark.parametrize("instance_id", TASK_IDS)
async def test_gold_patch_resolves_every_bundled_task(eval_node, instance_id):
    task = TASKS[instance_id]

    result = await evaluate(eval_node.evaluate, task.instance, task.gold_patch, omit_logs=True)

    report = result.report
    assert result.status == "RESOLVED_FULL", (report.error_reason, report.error_message)
    assert report.instance_id == instance_id
    assert report.patch_applied
    assert result.apply_method == "GIT_APPLY"
    assert sorted(report.fail_to_pass.success) == sorted(task.fail_to_pass)
    assert sorted(report.pass_to_pass.success) == sorted(task.pass_to_pass)
    assert not report.fail_to_pass.failure and not report.pass_to_pass.failure
    assert report.error_reason == "" and report.failed_phase == 0
    assert report.test_exit_code == 0


@pytest.mark.parametrize("patch", [b"", b"\n  \n"], ids=["empty", "whitespace"])
async def test_empty_patch_is_unresolved_and_runs_no_tests(eval_node, patch):
    result = await evaluate(eval_node.evaluate, TASKS[LISTUTILS].instance, patch)

    report = result.report
    assert result.status == "UNRESOLVED"
    assert report.error_reason == "EMPTY_PATCH"
    assert not report.patch_applied and result.apply_method == "NONE"
    assert "RUN_TESTS" not in result.phases
    assert report.test_exit_code == -1


async def test_wrong_patch_is_unresolved_naming_the_pass_to_pass_tests_it_breaks(eval_node):
    task = TASKS[SEMVERLITE]
    assert task.wrong_patch and task.wrong_patch_breaks

    result = await evaluate(eval_node.evaluate, task.instance, task.wrong_patch, omit_logs=True)

    report = result.report
    assert result.status == "UNRESOLVED"
    assert report.patch_applied
    assert sorted(report.pass_to_pass.failure) == sorted(task.wrong_patch_breaks)
    assert sorted(report.fail_to_pass.success) == sorted(task.fail_to_pass)
    assert not set(report.pass_to_pass.success) & set(task.wrong_patch_breaks)


# -- patches that do not apply, or only with effort ----------------------------------------------
NO_SUCH_FILE_PATCH = """\
diff --git a/listutils/no_such_module.py b/listutils/no_such_module.py
index 1111111..2222222 100644
--- a/listutils/no_such_module.py
+++ b/listutils/no_such_module.py
@@ -1,3 +1,3 @@
 a = 1
-b = 2
+b = 3
 c = 4
"""


@pytest.mark.parametrize(
    ("patch", "complaint"),
    [
        ("this is not a patch\njust some text\n", "No valid patches in input"),
        (NO_SUCH_FILE_PATCH, "listutils/no_such_module.py: No such file or directory"),
    ],
    ids=["garbage", "missing-file"],
)
async def test_malformed_patch_fails_to_apply_with_gits_complaint(eval_node, patch, complaint):
    result = await evaluate(eval_node.evaluate, TASKS[LISTUTILS].instance, patch)

    report = result.report
    assert result.status == "PATCH_FAILED"
    assert report.error_reason == "PATCH_APPLY_FAILED"
    assert complaint in report.error_message
    assert not report.patch_applied and result.apply_method == "NONE"
    assert "RUN_TESTS" not in result.phases
    assert report.test_exit_code == -1
    assert report.failed_phase == 2  # EVALUATION_PHASE_APPLY_PATCH


async def test_patch_with_drifted_context_applies_with_fuzz_and_records_the_method(eval_node):
    task = TASKS[LISTUTILS]
    drifted = _drift_first_context_line(task.gold_patch)

    result = await evaluate(eval_node.evaluate, task.instance, drifted)

    report = result.report
    assert report.patch_applied
    assert result.apply_method != "GIT_APPLY"
    assert result.apply_method == "PATCH_FUZZ"
    assert result.status == "RESOLVED_FULL", (report.error_reason, report.error_message)
    # The failed attempts before it left no trace: the apply log shows each method tried.
    assert b"with fuzz 1" in result.log_of("APPLY_PATCH")


async def test_five_megabyte_patch_is_applied_and_graded(eval_node):
    task = TASKS[LISTUTILS]
    line = "x" * 99
    count = (5 << 20) // (len(line) + 1)
    big_file = (
        "diff --git a/big_data.txt b/big_data.txt\n"
        "new file mode 100644\n"
        "--- /dev/null\n"
        "+++ b/big_data.txt\n"
        f"@@ -0,0 +1,{count} @@\n" + f"+{line}\n" * count
    )
    patch = task.gold_patch + big_file
    assert len(patch) > 5 << 20

    result = await evaluate(eval_node.evaluate, task.instance, patch, omit_logs=True)

    assert result.status == "RESOLVED_FULL", result.report.error_message
    assert result.apply_method == "GIT_APPLY"


async def test_patch_without_a_final_newline_applies(eval_node):
    task = TASKS[LISTUTILS]

    result = await evaluate(
        eval_node.evaluate, task.instance, task.gold_patch.rstrip("\n"), omit_logs=True
    )

    assert result.status == "RESOLVED_FULL", result.report.error_message
    assert result.apply_method == "GIT_APPLY"


async def test_candidate_patch_cannot_remove_the_tests_it_is_graded_on(eval_node):
    task = TASKS[LISTUTILS]
    deletes_tests = await _deletion_patch(eval_node, task.image_name, "tests/test_core.py")

    result = await evaluate(
        eval_node.evaluate, task.instance, task.gold_patch + deletes_tests, omit_logs=True
    )

    # The test file is back at base_commit before the test patch: graded on the real tests.
    assert result.apply_method == "GIT_APPLY"
    assert result.status == "RESOLVED_FULL", result.report.error_message
    assert sorted(result.report.pass_to_pass.success) == sorted(task.pass_to_pass)


async def test_candidate_patch_cannot_preempt_a_test_file_the_test_patch_adds(eval_node):
    task = TASKS["swerl-examples__textkit-9"]
    assert "new file mode" in task.test_patch.split("\n", 2)[1]
    # The candidate "writes" the new test file itself, with tests that always pass.
    fake_tests = (
        "diff --git a/tests/test_slugify.py b/tests/test_slugify.py\n"
        "new file mode 100644\n"
        "--- /dev/null\n"
        "+++ b/tests/test_slugify.py\n"
        "@@ -0,0 +1,2 @@\n"
        "+def test_always_passes():\n"
        "+    pass\n"
    )

    result = await evaluate(
        eval_node.evaluate, task.instance, task.gold_patch + fake_tests, omit_logs=True
    )

    assert result.status == "RESOLVED_FULL", result.report.error_message
    assert sorted(result.report.fail_to_pass.success) == sorted(task.fail_to_pass)


async def test_test_patch_that_does_not_apply_is_an_infra_error(eval_node):
    task = TASKS[LISTUTILS]
    broken = task.test_patch.replace(" def test_chunked_empty_input():", " def test_renamed():")
    assert broken != task.test_patch

    result = await evaluate(
        eval_node.evaluate, task_instance(LISTUTILS, test_patch=broken), task.gold_patch
    )

    report = result.report
    assert result.status == "INFRA_ERROR"
    assert report.error_reason == "TEST_PATCH_FAILED"
    assert "tests/test_core.py" in report.error_message
    assert report.failed_phase == 3  # EVALUATION_PHASE_APPLY_TEST_PATCH
    assert "RUN_TESTS" not in result.phases


async def _deletion_patch(eval_node, image: str, path: str) -> str:
    """`git diff` deleting `path` at the image's base commit, made inside a sandbox of it."""
    created = await eval_node.sandboxes.CreateSandbox(
        sandbox_pb2.CreateSandboxRequest(
            request_id=uuid.uuid4().hex, image=image, workdir="/testbed"
        ),
        timeout=60,
    )
    sandbox_id = created.sandbox.sandbox_id
    try:
        diff = await SandboxClient(eval_node.channel).run(
            sandbox_id, f"git rm -q {path} && git diff --cached", timeout_s=30
        )
        assert diff.exit_code == 0, diff.stderr
        assert b"deleted file mode" in diff.stdout
        return diff.stdout.decode()
    finally:
        await eval_node.sandboxes.DestroySandbox(
            sandbox_pb2.DestroySandboxRequest(request_id=uuid.uuid4().hex, sandbox_id=sandbox_id),
            timeout=60,
        )


# -- eval scripts ---------------------------------------------------------------------------------
async def test_eval_script_with_a_line_that_is_exactly_eof_runs_as_written(eval_node):
    task = TASKS[LISTUTILS]
    # Heredocs ending in `EOF` (and swebench's own delimiter) must not end the script early:
    # the tests run after them, and their bodies reach the log intact.
    prelude = (
        "cat > /tmp/heredoc.txt <<'EOF'\n"
        "heredoc body line one\n"
        "EOF\n"
        "cat /tmp/heredoc.txt\n"
        "cat <<'EOF_114329324912'\n"
        "second heredoc body\n"
        "EOF\n"
        "EOF_114329324912\n"
    )
    script = task.eval_script.replace("cd /testbed\n", "cd /testbed\n" + prelude, 1)
    assert "\nEOF\n" in script and script.index(prelude) < script.index("pytest")

    result = await evaluate(
        eval_node.evaluate, task_instance(LISTUTILS, eval_script=script), task.gold_patch
    )

    assert result.status == "RESOLVED_FULL", result.report.error_message
    log = result.log_of("RUN_TESTS")
    assert b"heredoc body line one\n" in log
    assert b"second heredoc body\nEOF\n" in log


async def test_test_log_that_is_not_utf8_is_still_graded(eval_node):
    task = TASKS[LISTUTILS]
    # Tests print whatever bytes they like; grading must not trip over them.
    noisy = task.eval_script.replace(
        "cd /testbed\n", "cd /testbed\nprintf '\\377\\376 \\300\\n'\n", 1
    )
    assert noisy != task.eval_script

    result = await evaluate(
        eval_node.evaluate, task_instance(LISTUTILS, eval_script=noisy), task.gold_patch
    )

    assert b"\xff\xfe \xc0\n" in result.log_of("RUN_TESTS")
    assert result.status == "RESOLVED_FULL", result.report.error_message
    assert sorted(result.report.fail_to_pass.success) == sorted(task.fail_to_pass)


async def test_hung_tests_time_out_and_leave_no_process_behind(eval_node):
    task = TASKS[LISTUTILS]
    created = await eval_node.sandboxes.CreateSandbox(
        sandbox_pb2.CreateSandboxRequest(
            request_id=uuid.uuid4().hex, image=task.image_name, workdir="/testbed"
        ),
        timeout=60,
    )
    sandbox_id = created.sandbox.sandbox_id
    try:
        hanging = "#!/bin/bash\ncd /testbed\nsleep 1000 &\nsleep 1000\n"
        result = await evaluate(
            eval_node.evaluate,
            task_instance(LISTUTILS, eval_script=hanging),
            task.gold_patch,
            sandbox_id=sandbox_id,
            timeout_s=2,
        )

        report = result.report
        assert result.status == "TIMEOUT"
        assert report.error_reason == "TESTS_TIMED_OUT"
        assert report.failed_phase == 4  # EVALUATION_PHASE_RUN_TESTS
        assert report.patch_applied
        assert "GRADE" not in result.phases
        # The caller's sandbox outlives the evaluation, and nothing of the tests runs in it.
        ps = await SandboxClient(eval_node.channel).run(sandbox_id, "ps -eo cmd", timeout_s=30)
        assert ps.exit_code == 0, ps.stderr
        survivors = [c for c in ps.stdout.decode().splitlines() if "sleep 1000" in c]
        assert not survivors, survivors
    finally:
        await eval_node.sandboxes.DestroySandbox(
            sandbox_pb2.DestroySandboxRequest(request_id=uuid.uuid4().hex, sandbox_id=sandbox_id),
            timeout=60,
        )


async def test_missing_image_gives_an_infra_error_report_not_an_rpc_error(eval_node):
    absent = f"swerl-absent/never-built:{uuid.uuid4().hex}"
    task = TASKS[LISTUTILS]

    result = await evaluate(
        eval_node.evaluate, task_instance(LISTUTILS, image_name=absent), task.gold_patch
    )

    report = result.report
    assert result.status == "INFRA_ERROR"
    assert report.error_reason == "IMAGE_NOT_PRESENT"
    assert absent in report.error_message
    assert report.failed_phase == 1  # EVALUATION_PHASE_PREPARE
    assert result.phases == ["PREPARE"]


# -- eval specs: refused up front, or graded by exit code when asked -----------------------------
@pytest.mark.parametrize(
    ("changes", "code", "reason"),
    [
        ({"FAIL_TO_PASS": []}, grpc.StatusCode.INVALID_ARGUMENT, "EVAL_SPEC_EMPTY"),
        ({"log_parser": "no_such_parser"}, grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_LOG_PARSER"),
        (
            {"eval_type": "exit_code", "eval_script": ""},
            grpc.StatusCode.INVALID_ARGUMENT,
            "EVAL_SPEC_EMPTY",
        ),
        ({"eval_type": "vibes"}, grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_EVAL_TYPE"),
        ({"image_name": ""}, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INSTANCE"),
        (
            {"image_name": "Not A Valid:Reference"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_IMAGE_REFERENCE",
        ),
    ],
    ids=[
        "no-fail-to-pass",
        "unknown-log-parser",
        "exit-code-without-script",
        "unknown-eval-type",
        "no-image-no-sandbox",
        "malformed-image",
    ],
)
async def test_bad_eval_spec_fails_the_call_before_anything_streams(
    eval_node, changes, code, reason
):
    err, streamed = await evaluate_failure(
        eval_node.evaluate, task_instance(LISTUTILS, **changes), TASKS[LISTUTILS].gold_patch
    )

    assert_status(err, code, reason)
    assert streamed == []


async def test_unknown_sandbox_is_not_found_before_anything_streams(eval_node):
    err, streamed = await evaluate_failure(
        eval_node.evaluate,
        TASKS[LISTUTILS].instance,
        TASKS[LISTUTILS].gold_patch,
        sandbox_id="sbx-" + uuid.uuid4().hex[:20],
    )

    assert_status(err, grpc.StatusCode.NOT_FOUND, "SANDBOX_NOT_FOUND")
    assert streamed == []


@pytest.mark.parametrize(
    ("exit_code", "status"), [(0, "RESOLVED_FULL"), (1, "UNRESOLVED")], ids=["exit-0", "exit-1"]
)
async def test_exit_code_grading_when_asked_for_explicitly(eval_node, exit_code, status):
    instance = task_instance(
        LISTUTILS,
        eval_type="exit_code",
        eval_script=f"#!/bin/bash\necho graded by exit code\nexit {exit_code}\n",
        FAIL_TO_PASS=[],
        PASS_TO_PASS=[],
    )

    result = await evaluate(eval_node.evaluate, instance, TASKS[LISTUTILS].gold_patch)

    report = result.report
    assert result.status == status
    assert report.test_exit_code == exit_code
    assert not report.fail_to_pass.success and not report.fail_to_pass.failure
    assert b"graded by exit code" in result.log_of("RUN_TESTS")


async def test_eval_script_exiting_zero_does_not_resolve_failing_tests(eval_node):
    task = TASKS[LISTUTILS]
    # The ordinary (pytest-graded) instance, with a script that swallows pytest's exit code.
    swallowing = task.eval_script.rstrip("\n") + " || true\nexit 0\n"

    result = await evaluate(
        eval_node.evaluate, task_instance(LISTUTILS, eval_script=swallowing), HARMLESS_PATCH
    )

    report = result.report
    assert report.patch_applied
    assert report.test_exit_code == 0
    assert result.status == "UNRESOLVED"
    assert sorted(report.fail_to_pass.failure) == sorted(task.fail_to_pass)


async def test_timeout_longer_than_the_longest_sandbox_lifetime_is_accepted(eval_node):
    task = TASKS[LISTUTILS]
    two_days_s = 2 * 24 * 3600.0
    assert two_days_s > eval_node.node.settings.max_ttl_s

    result = await evaluate(
        eval_node.evaluate, task.instance, task.gold_patch, timeout_s=two_days_s, omit_logs=True
    )

    assert result.status == "RESOLVED_FULL", result.report.error_message


# -- the stream ------------------------------------------------------------------------------------
async def test_phases_stream_in_order_with_logs_and_one_report_last(eval_node):
    task = TASKS[LISTUTILS]

    result = await evaluate(eval_node.evaluate, task.instance, task.gold_patch)

    assert result.phases == PHASES
    assert result.kinds.count("report") == 1 and result.kinds[-1] == "report"
    assert result.status == "RESOLVED_FULL"
    # Each log chunk belongs to the phase announced last before it.
    current = None
    for response in result.responses:
        kind = response.WhichOneof("kind")
        if kind == "phase":
            current = response.phase.phase
        elif kind == "log":
            assert response.log.phase == current
    assert b"Checking patch listutils/core.py" in result.log_of("APPLY_PATCH")
    assert result.log_of("APPLY_TEST_PATCH")
    run_log = result.log_of("RUN_TESTS")
    assert b">>>>> Start Test Output" in run_log and b">>>>> End Test Output" in run_log
    for test in task.fail_to_pass:
        assert f"PASSED {test}".encode() in run_log


async def test_omit_logs_streams_phases_and_the_report_only(eval_node):
    task = TASKS[LISTUTILS]

    result = await evaluate(eval_node.evaluate, task.instance, task.gold_patch, omit_logs=True)

    assert result.phases == PHASES
    assert result.logs == []
    assert set(result.kinds) == {"phase", "report"}
    assert result.status == "RESOLVED_FULL"
