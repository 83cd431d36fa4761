"""Our verdicts are swebench's: the same test log graded by `swerl.exec.evaluate` and by swebench
4.1.0's own `get_eval_report` + `get_resolution_status` gives the same status and test lists.

Checked on the real test logs of the bundled tasks (through the real EvaluateService and dockerd)
and, without Docker, on synthetic logs in the formats of real SWE-bench repositories (pytest,
pytest with colours, Django's runner, sympy's runner), each graded both as a classic SWE-bench
instance and as an instance that names the repository's log parser explicitly.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from typing import Any

import pytest
from swebench.harness.grading import get_eval_report, get_resolution_status
from swebench.harness.test_spec.test_spec import make_test_spec
from testkit.evaluate import TASK_IDS, TASKS, evaluate

from swerl.exec.evaluate import Report, build_eval_spec, grade

SEMVERLITE = "swerl-examples__semverlite-41"
START = ">>>>> Start Test Output"
END = ">>>>> End Test Output"
# swebench's resolution values, as EvaluationStatus names.
OUR_STATUS = {
    "RESOLVED_FULL": "RESOLVED_FULL",
    "RESOLVED_PARTIAL": "RESOLVED_PARTIAL",
    "RESOLVED_NO": "UNRESOLVED",
}


@dataclass(frozen=True)
class Verdict:
    status: str
    f2p_success: list[str]
    f2p_failure: list[str]
    p2p_success: list[str]
    p2p_failure: list[str]


def swebench_verdict(test_spec: Any, instance_id: str, patch: str, log: bytes) -> Verdict:
    """What swebench itself says about `log`, in our status names."""
    with tempfile.NamedTemporaryFile("wb", suffix=".log") as handle:
        handle.write(log)
        handle.flush()
        prediction = {
            "instance_id": instance_id,
            "model_name_or_path": "parity-check",
            "model_patch": patch,
        }
        result = get_eval_report(test_spec, prediction, handle.name, True)[instance_id]
    tests = result["tests_status"]
    status = OUR_STATUS[get_resolution_status(tests)]
    assert result["resolved"] == (status == "RESOLVED_FULL")
    return Verdict(
        status,
        tests["FAIL_TO_PASS"]["success"],
        tests["FAIL_TO_PASS"]["failure"],
        tests["PASS_TO_PASS"]["success"],
        tests["PASS_TO_PASS"]["failure"],
    )


def our_verdict(report: Report) -> Verdict:
    return Verdict(
        report.status,
        report.f2p_success,
        report.f2p_failure,
        report.p2p_success,
        report.p2p_failure,
    )


# -- (a) the bundled tasks' real test logs ---------------------------------------------------------
@pytest.mark.parametrize(
    ("instance_id", "kind"),
    [(instance_id, "gold") for instance_id in TASK_IDS] + [(SEMVERLITE, "wrong")],
)
async def test_report_matches_swebench_on_the_real_test_log(eval_node, instance_id, kind):
    task = TASKS[instance_id]
    patch = task.gold_patch if kind == "gold" else task.wrong_patch
    assert patch

    result = await evaluate(eval_node.evaluate, task.instance, patch)

    log = result.log_of("RUN_TESTS")
    assert START.encode() in log and END.encode() in log
    test_spec = build_eval_spec(task.instance).test_spec
    expected = await asyncio.to_thread(swebench_verdict, test_spec, instance_id, patch, log)
    report = result.report
    got = Verdict(
        result.status,
        list(report.fail_to_pass.success),
        list(report.fail_to_pass.failure),
        list(report.pass_to_pass.success),
        list(report.pass_to_pass.failure),
    )
    assert got == expected
    assert got.status == ("RESOLVED_FULL" if kind == "gold" else "UNRESOLVED")


# -- (b) synthetic logs in real repositories' formats ----------------------------------------------
@dataclass(frozen=True)
class LogFormat:
    repo: str
    version: str
    log_parser: str  # swebench's parse_log_<name> for this repo, for the explicit variant
    test_file: str
    noise: str  # a result line outside the markers that would flip the verdict if parsed
    body: str
    passing: tuple[str, ...]
    failing: str
    erroring: str


PYTEST = LogFormat(
    repo="pytest-dev/pytest",
    version="5.4",
    log_parser="pytest",
    test_file="testing/test_mark.py",
    noise="FAILED testing/test_mark.py::test_marker_applies - from a stale run",
    body="""\
============================= test session starts ==============================
platform linux -- Python 3.9.20, pytest-5.4.1.dev154+gbe68496, py-1.11.0, pluggy-0.13.1
rootdir: /testbed, inifile: tox.ini
collected 6 items

testing/test_mark.py ..F.Ex                                              [100%]

=================================== FAILURES ===================================
_____________________________ test_marker_is_kept ______________________________
    def test_marker_is_kept():
>       assert 1 == 2
E       assert 1 == 2
testing/test_mark.py:31: AssertionError
=========================== short test summary info ============================
PASSED testing/test_mark.py::test_marker_applies
PASSED testing/test_mark.py::TestKeywords::test_select[not_foo-expected1]
XFAIL testing/test_mark.py::test_known_bug
  reason: not fixed yet
SKIPPED [1] testing/test_mark.py:50: needs a display
FAILED testing/test_mark.py::test_marker_is_kept - assert 1 == 2
ERROR testing/test_mark.py::test_setup_breaks - RuntimeError: fixture exploded
============= 1 failed, 2 passed, 1 skipped, 1 xfailed, 1 error in 0.31s =============
""",
    passing=(
        "testing/test_mark.py::test_marker_applies",
        "testing/test_mark.py::TestKeywords::test_select[not_foo-expected1]",
        "testing/test_mark.py::test_known_bug",
    ),
    failing="testing/test_mark.py::test_marker_is_kept",
    erroring="testing/test_mark.py::test_setup_breaks",
)

ASTROPY = LogFormat(
    repo="astropy/astropy",
    version="5.0",
    log_parser="astropy",
    test_file="astropy/units/tests/test_quantity.py",
    noise="FAILED astropy/units/tests/test_quantity.py::test_copy - stale",
    body="""\
============================= test session starts ==============================
collected 4 items

astropy/units/tests/test_quantity.py ..FE                                [100%]

=========================== short test summary info ============================
\x1b[32mPASSED\x1b[0m astropy/units/tests/test_quantity.py::test_copy
\x1b[32mPASSED\x1b[0m astropy/units/tests/test_quantity.py::TestQuantityCreation::test_1
\x1b[31mFAILED\x1b[0m astropy/units/tests/test_quantity.py::test_unit_identity - AssertionError
\x1b[31mERROR\x1b[0m astropy/units/tests/test_quantity.py::test_with_remote_data
\x1b[31m=================== 1 failed, 2 passed, 1 error in 1.02s ===================\x1b[0m
""",
    passing=(
        "astropy/units/tests/test_quantity.py::test_copy",
        "astropy/units/tests/test_quantity.py::TestQuantityCreation::test_1",
    ),
    failing="astropy/units/tests/test_quantity.py::test_unit_identity",
    erroring="astropy/units/tests/test_quantity.py::test_with_remote_data",
)

DJANGO = LogFormat(
    repo="django/django",
    version="4.0",
    log_parser="django",
    test_file="tests/migrations/test_operations.py",
    noise="test_add_field (migrations.test_operations.OperationTests) ... FAIL",
    body="""\
Testing against Django installed in '/testbed/django'
Importing application migrations
Found 5 test(s).
Skipping setup of unused database(s): other.
System check identified no issues (0 silenced).
test_add_field (migrations.test_operations.OperationTests) ... ok
test_alter_field (migrations.test_operations.OperationTests) ... printed by the test
ok
test_remove_field (migrations.test_operations.OperationTests) ... FAIL
test_rename_model (migrations.test_operations.OperationTests) ... ERROR
test_run_sql (migrations.test_operations.OperationTests) ... skipped 'no sqlparse'

======================================================================
ERROR: test_rename_model (migrations.test_operations.OperationTests)
----------------------------------------------------------------------
Traceback (most recent call last):
RuntimeError: boom

======================================================================
FAIL: test_remove_field (migrations.test_operations.OperationTests)
----------------------------------------------------------------------
Traceback (most recent call last):
AssertionError: 1 != 2

----------------------------------------------------------------------
Ran 5 tests in 0.412s

FAILED (failures=1, errors=1, skipped=1)
""",
    passing=(
        "test_add_field (migrations.test_operations.OperationTests)",
        "test_alter_field (migrations.test_operations.OperationTests)",
    ),
    failing="test_remove_field (migrations.test_operations.OperationTests)",
    erroring="test_rename_model (migrations.test_operations.OperationTests)",
)

SYMPY = LogFormat(
    repo="sympy/sympy",
    version="1.12",
    log_parser="sympy",
    test_file="sympy/core/tests/test_basic.py",
    noise="test_subs F",
    body="""\
============================= test process starts ==============================
executable:         /opt/miniconda3/envs/testbed/bin/python  (3.9.19-final-0) [CPython]
architecture:       64-bit
random seed:        12345678

sympy/core/tests/test_basic.py[4]
test_subs ok
test_free_symbols F
test_rewrite E
test_atoms ok
test_sizeof ok                                                            [FAIL]


________________________________________________________________________________
____________ sympy/core/tests/test_basic.py:test_free_symbols _____________
Traceback (most recent call last):
AssertionError
________________________________________________________________________________
______________ sympy/core/tests/test_basic.py:test_rewrite ________________
Traceback (most recent call last):
TypeError: boom

====== tests finished: 2 passed, 1 failed, 1 exceptions, in 0.05 seconds =======
DO *NOT* COMMIT!
""",
    passing=("test_subs", "test_atoms"),
    failing="test_free_symbols",
    erroring="test_rewrite",
)

FORMATS = {"pytest": PYTEST, "astropy": ASTROPY, "django": DJANGO, "sympy": SYMPY}


def _scenario(fmt: LogFormat, name: str) -> tuple[list[str], list[str], str]:
    """FAIL_TO_PASS, PASS_TO_PASS and swebench's expected status for one scenario."""
    first, *others = fmt.passing
    if name == "full":
        return [first], others, "RESOLVED_FULL"
    if name == "partial":
        return [first, fmt.failing], others, "RESOLVED_PARTIAL"
    if name == "pass-to-pass-errors":
        return [first], [*others, fmt.erroring], "UNRESOLVED"
    if name == "fail-to-pass-missing":
        return [f"{first}_not_in_the_log"], others, "UNRESOLVED"
    if name == "nothing-fixed":
        return [fmt.failing, fmt.erroring], others, "UNRESOLVED"
    raise AssertionError(name)


SCENARIOS = ["full", "partial", "pass-to-pass-errors", "fail-to-pass-missing", "nothing-fixed"]


def _classic_instance(fmt: LogFormat, f2p: list[str], p2p: list[str]) -> dict[str, Any]:
    slug = fmt.repo.replace("/", "__")
    return {
        "instance_id": f"{slug}-parity",
        "repo": fmt.repo,
        "version": fmt.version,
        "base_commit": "0123456789abcdef0123456789abcdef01234567",
        "environment_setup_commit": "0123456789abcdef0123456789abcdef01234567",
        "problem_statement": "a synthetic instance for grading parity",
        "hints_text": "",
        "patch": "",
        "test_patch": (
            f"diff --git a/{fmt.test_file} b/{fmt.test_file}\n"
            f"--- a/{fmt.test_file}\n"
            f"+++ b/{fmt.test_file}\n"
            "@@ -1,2 +1,3 @@\n"
            " import os\n"
            "+import sys\n"
            " \n"
        ),
        "FAIL_TO_PASS": f2p,
        "PASS_TO_PASS": p2p,
    }


def _log(fmt: LogFormat) -> bytes:
    lines = [
        "+ git checkout 0123456789abcdef0123456789abcdef01234567 " + fmt.test_file,
        fmt.noise,
        START,
        fmt.body.rstrip("\n"),
        END,
        "+ git checkout 0123456789abcdef0123456789abcdef01234567 " + fmt.test_file,
    ]
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture
def offline_swebench(monkeypatch):
    """swebench's make_test_spec also writes the environment image's setup script, for which it
    downloads a repository's requirements.txt / environment.yml from GitHub (Django, newer
    sympy). Grading reads nothing of it; here those downloads fail loudly instead."""
    import swebench.harness.test_spec.python as swebench_python

    def no_network(*_args, **_kwargs):
        raise AssertionError("swebench tried to download environment files")

    for name in ("get_requirements", "get_environment_yml"):
        monkeypatch.setattr(swebench_python, name, no_network)


def _reference_test_spec(instance: dict[str, Any]) -> Any:
    """swebench's own TestSpec for a classic instance, minus the environment setup script (the
    only part that needs the network; grading does not read it)."""
    import swebench.harness.test_spec.test_spec as swebench_test_spec

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(swebench_test_spec, "make_env_script_list", lambda *_args: [])
        return make_test_spec(instance)


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_classic_eval_spec_is_swebenchs_eval_script_and_needs_no_network(
    fmt_name, offline_swebench
):
    fmt = FORMATS[fmt_name]
    instance = _classic_instance(fmt, [fmt.passing[0]], list(fmt.passing[1:]))

    spec = build_eval_spec(instance)

    reference = _reference_test_spec(instance)
    assert spec.eval_script == reference.eval_script
    assert spec.test_spec.eval_script == reference.eval_script
    assert (spec.test_spec.repo, spec.test_spec.version) == (fmt.repo, fmt.version)
    assert spec.applies_test_patch_itself and not spec.exit_code_only


@pytest.mark.parametrize("mode", ["classic", "explicit-parser"])
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_grade_matches_swebench_on_a_synthetic_log(fmt_name, scenario, mode, offline_swebench):
    fmt = FORMATS[fmt_name]
    f2p, p2p, expected_status = _scenario(fmt, scenario)
    classic = _classic_instance(fmt, f2p, p2p)
    # The explicit variant is the same row with its own eval_script and the repo's parser
    # named: it must grade exactly as swebench grades the real repository.
    instance = (
        classic
        if mode == "classic"
        else dict(classic, eval_script="python -m pytest -rA\n", log_parser=fmt.log_parser)
    )
    patch = "diff --git a/fix.py b/fix.py\n"
    log = _log(fmt)

    report = Report(instance_id=classic["instance_id"])
    grade(build_eval_spec(instance), patch.encode(), log, report)
    reference = _reference_test_spec(classic)
    expected = swebench_verdict(reference, classic["instance_id"], patch, log)

    assert expected.status == expected_status, "the synthetic log is not what the case means"
    assert our_verdict(report) == expected
    assert report.error_reason == ""
