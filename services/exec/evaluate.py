"""Evaluation on the exec node: apply a patch in a fresh sandbox, run the task's tests, grade.

Grading is the `swebench` package's own (pinned): its log parsers, `get_eval_report` and
`get_resolution_status`. An instance either carries `eval_script` + `log_parser` (run as given)
or is a classic SWE-bench instance whose eval script swebench builds from `repo`/`version`. The
eval script's exit code is never the verdict unless the instance asks for `eval_type=exit_code`;
the report carries it anyway (the test command's own exit code where the script marks its test
section the way swebench's does), with warnings when the log shows an install or network step
failing.

Evaluation sandboxes get no network unless the node's operator turns on `evaluation_network`
(ExecSettings): some tasks install their package or fetch test data over the network, as
SWE-bench's own harness allows. Agent sandboxes never get network from that setting. Offline,
pip fails at once instead of retrying, and the report says which way the evaluation ran.

Patch, test patch and eval script travel as files through the sandbox's I/O directory (no
heredocs, no argv limits). Infrastructure failures (image missing, container gone, Docker down)
end in an INFRA_ERROR report with a reason, never in an unresolved verdict, so training can drop
such episodes instead of punishing them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from swerl.chassis.errors import InvalidArgument, SwerlError
from swerl.exec.image_ensure import validate_image_reference
from swerl.exec.output import STDOUT
from swerl.exec.sandboxes import CreateSpec, SandboxManager
from swerl.exec.settings import DEFAULT_EVALUATION_TIMEOUT_S
from swerl.exec.shell import CONTAINER_IO_DIR, CommandSpec, Exit, Output
from swerl.exec.verdicts import empty_patch

log = structlog.get_logger(__name__)

REPO_DIR = "/testbed"
MAX_LOG_BYTES = 128 << 20
START_MARKER = ">>>>> Start Test Output"
END_MARKER = ">>>>> End Test Output"
EXIT_MARKER = ">>>>> Test Exit Code"
# How swebench's eval.sh closes its test section (a traced no-op under `set -x`).
_SWEBENCH_END_LINE = f": '{END_MARKER}'"
_EXIT_LINE = re.compile(rb"^>>>>> Test Exit Code: (-?\d+)\s*$", re.MULTILINE)
# Offline, pip's five retries with back-off only delay the failure (about 10 s per install).
_OFFLINE_ENV = "export PIP_RETRIES=0 PIP_TIMEOUT=5\n"
# Log lines that show a step needed the network and did not get it.
_NETWORK_FAILURES = re.compile(
    rb"Failed to establish a new connection|Temporary failure in name resolution|"
    rb"Network is unreachable|Could not resolve host|Name or service not known|"
    rb"No matching distribution found|Could not find a version that satisfies",
)
# pip's own failure line, or no pip (or python) to run at all.
_INSTALL_FAILURE = re.compile(
    rb"^(?:[ \t]*ERROR: .*|.*No module named pip.*|.*command not found.*)$", re.MULTILINE
)
_INSTALL_TRACE = re.compile(rb"^\+ (?:python[0-9.]* -m )?pip[0-9.]* install .*$", re.MULTILINE)
# Synthetic swebench repo keys for instances that name their own log parser, so a dataset's
# explicit parser never changes how swebench grades a real repository of the same name.
_EXPLICIT_REPO = "swerl-explicit/{parser}/{eval_type}"


class EvalSpecEmpty(InvalidArgument):
    reason = "EVAL_SPEC_EMPTY"


class UnknownLogParser(InvalidArgument):
    reason = "UNKNOWN_LOG_PARSER"


class UnknownEvalType(InvalidArgument):
    reason = "UNKNOWN_EVAL_TYPE"


class InvalidInstance(InvalidArgument):
    reason = "INVALID_INSTANCE"


# -- events ----------------------------------------------------------------------------------
PHASES = ("PREPARE", "APPLY_PATCH", "APPLY_TEST_PATCH", "RUN_TESTS", "GRADE")
STATUSES = (
    "RESOLVED_FULL",
    "RESOLVED_PARTIAL",
    "UNRESOLVED",
    "PATCH_FAILED",
    "TIMEOUT",
    "INFRA_ERROR",
)
APPLY_METHODS = ("NONE", "GIT_APPLY", "GIT_APPLY_3WAY", "GIT_APPLY_REJECT", "PATCH_FUZZ")


@dataclass(frozen=True)
class PhaseEvent:
    phase: str
    time: float


@dataclass(frozen=True)
class LogEvent:
    phase: str
    stream: int
    data: bytes


@dataclass(frozen=True)
class EvalWarning:
    """Something the log shows went wrong that the verdict does not account for."""

    reason: str  # INSTALL_STEP_FAILED | NETWORK_STEP_FAILED
    message: str


@dataclass
class Report:
    instance_id: str
    status: str = "INFRA_ERROR"
    patch_applied: bool = False
    apply_method: str = "NONE"
    f2p_success: list[str] = field(default_factory=list)
    f2p_failure: list[str] = field(default_factory=list)
    p2p_success: list[str] = field(default_factory=list)
    p2p_failure: list[str] = field(default_factory=list)
    test_exit_code: int = -1
    total_s: float = 0.0
    apply_s: float = 0.0
    tests_s: float = 0.0
    grade_s: float = 0.0
    sandbox_s: float = 0.0
    error_reason: str = ""
    error_message: str = ""
    failed_phase: str = ""
    # "none" or "bridge": the network the evaluation's commands had.
    network: str = "none"
    # The package index the install steps were pointed at ("" for pip's own default).
    package_index: str = ""
    warnings: list[EvalWarning] = field(default_factory=list)


Event = PhaseEvent | LogEvent | Report


# -- the eval spec -----------------------------------------------------------------------------
@dataclass(frozen=True)
class EvalSpec:
    """What grading needs, settled before anything runs (bad specs fail the call up front)."""

    instance: Mapping[str, Any]
    eval_script: str
    test_patch: str
    test_spec: Any  # swebench TestSpec
    exit_code_only: bool
    applies_test_patch_itself: bool
    # The script prints the harness's start/end markers itself (swebench's eval.sh, or one
    # pasted from it): run as it is, never wrapped in a second pair.
    prints_markers: bool = False


def _as_list(value: Any) -> list[str]:
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else []
    return [str(v) for v in value or []]


def build_eval_spec(instance: Mapping[str, Any]) -> EvalSpec:
    """Validates the instance's eval spec and prepares swebench's TestSpec for it."""
    from swebench.harness.constants import (
        FAIL_ONLY_REPOS,
        MAP_REPO_TO_EXT,
        MAP_REPO_VERSION_TO_SPECS,
    )
    from swebench.harness.log_parsers import MAP_REPO_TO_PARSER
    from swebench.harness.test_spec.create_scripts import make_eval_script_list
    from swebench.harness.test_spec.test_spec import TestSpec

    instance_id = str(instance.get("instance_id") or "")
    if not instance_id:
        raise InvalidInstance("instance.instance_id is required")
    f2p = _as_list(instance.get("FAIL_TO_PASS"))
    p2p = _as_list(instance.get("PASS_TO_PASS"))
    eval_script = str(instance.get("eval_script") or "")
    eval_type = str(instance.get("eval_type") or "").lower()
    parser_name = str(instance.get("log_parser") or "")
    repo = str(instance.get("repo") or "")
    version = str(instance.get("version") or "")
    if eval_type not in ("", "pytest", "pass_and_fail", "fail_only", "exit_code"):
        raise UnknownEvalType(
            f"eval_type {eval_type!r} is not one of pass_and_fail, fail_only, exit_code",
            instance_id=instance_id,
        )
    if eval_type == "exit_code":
        if not eval_script.strip():
            raise EvalSpecEmpty("eval_type exit_code needs an eval_script", instance_id=instance_id)
        return EvalSpec(
            instance, eval_script, str(instance.get("test_patch") or ""), None, True, False
        )
    if not f2p:
        # An empty FAIL_TO_PASS would make every patch "resolved".
        raise EvalSpecEmpty(
            "FAIL_TO_PASS is empty: nothing would distinguish a fix from no fix",
            instance_id=instance_id,
        )
    if eval_script.strip():
        if parser_name or repo not in MAP_REPO_TO_PARSER:
            parser = _find_parser(parser_name or "pytest", instance_id)
        else:
            # A script for a repository swebench knows (e.g. swebench's own eval.sh pasted
            # into the row) is read with that repository's parser, as swebench reads it.
            parser = MAP_REPO_TO_PARSER[repo]
        fail_only = eval_type == "fail_only" or (
            not eval_type and not parser_name and repo in FAIL_ONLY_REPOS
        )
        key = _EXPLICIT_REPO.format(parser=parser.__name__, eval_type=eval_type or "pytest")
        MAP_REPO_TO_PARSER[key] = parser
        MAP_REPO_VERSION_TO_SPECS.setdefault(key, {}).setdefault(version, {"test_cmd": ""})
        if fail_only:
            FAIL_ONLY_REPOS.add(key)
        test_spec = TestSpec(
            instance_id=instance_id,
            repo=key,
            version=version,
            repo_script_list=[],
            eval_script_list=[],
            env_script_list=[],
            arch="x86_64",
            FAIL_TO_PASS=f2p,
            PASS_TO_PASS=p2p,
            language="py",
            docker_specs={},
            namespace=None,
        )
        return EvalSpec(
            instance,
            eval_script,
            str(instance.get("test_patch") or ""),
            test_spec,
            False,
            False,
            prints_markers=START_MARKER in eval_script,
        )
    if repo not in MAP_REPO_VERSION_TO_SPECS or version not in MAP_REPO_VERSION_TO_SPECS[repo]:
        raise EvalSpecEmpty(
            f"no eval_script given and swebench has no eval spec for {repo}@{version}",
            instance_id=instance_id,
        )
    for key in ("base_commit", "test_patch"):
        if not instance.get(key):
            raise InvalidInstance(f"instance.{key} is required", instance_id=instance_id)
    classic = dict(instance)
    classic["FAIL_TO_PASS"], classic["PASS_TO_PASS"] = f2p, p2p
    # Not make_test_spec: it also writes the environment image's setup script, downloading the
    # repo's requirements.txt / environment.yml from GitHub (Django, newer sympy, ...) — a
    # blocking fetch per evaluation that fails on an offline node. Grading needs the eval script.
    specs = MAP_REPO_VERSION_TO_SPECS[repo][version]
    test_spec = TestSpec(
        instance_id=instance_id,
        repo=repo,
        version=version,
        repo_script_list=[],
        eval_script_list=make_eval_script_list(
            classic, specs, "testbed", REPO_DIR, classic["base_commit"], classic["test_patch"]
        ),
        env_script_list=[],
        arch="x86_64",
        FAIL_TO_PASS=f2p,
        PASS_TO_PASS=p2p,
        language=MAP_REPO_TO_EXT[repo],
        docker_specs=specs.get("docker_specs", {}),
        namespace=None,
    )
    return EvalSpec(
        instance,
        test_spec.eval_script,
        str(instance["test_patch"]),
        test_spec,
        False,
        True,
        prints_markers=True,
    )


def _find_parser(name: str, instance_id: str):
    import swebench.harness.log_parsers as parsers

    short = name.removeprefix("parse_log_")
    for module_name in ("python", "javascript", "go", "java", "rust", "c", "php", "ruby"):
        module = getattr(parsers, module_name, None)
        parser = getattr(module, f"parse_log_{short}", None) if module else None
        if parser is not None:
            return parser
    raise UnknownLogParser(
        f"swebench has no log parser named {name!r}", instance_id=instance_id, log_parser=name
    )


def _patched_paths(patch: str) -> list[str]:
    paths: list[str] = []
    for match in re.finditer(r"^diff --git a/(\S+) b/(\S+)$", patch, re.MULTILINE):
        for path in match.groups():
            if path not in paths:
                paths.append(path)
    return paths


def _shell_words(words: list[str]) -> str:
    return " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)


# -- the evaluator -----------------------------------------------------------------------------
class CommandFailed(Exception):
    """A harness step's command could not run (the sandbox is gone, Docker failed); `reason` is
    the node's own for it (e.g. DOCKER_UNAVAILABLE), which the report carries."""

    def __init__(self, message: str, reason: str = "SANDBOX_FAILED") -> None:
        super().__init__(message)
        self.reason = reason


class Evaluator:
    def __init__(self, manager: SandboxManager) -> None:
        self._m = manager
        settings = manager.settings
        self._network = "bridge" if settings.evaluation_network else "none"
        if settings.evaluation_host_network_test_only:
            self._network = "host"
        self._package_index = manager.settings.evaluation_package_index

    @property
    def manager(self) -> SandboxManager:
        """The sandboxes it evaluates in (the servicer checks lease tokens against it)."""
        return self._m

    async def evaluate(
        self,
        instance: Mapping[str, Any],
        patch: bytes,
        *,
        sandbox_id: str = "",
        timeout_s: float = 0.0,
        omit_logs: bool = False,
    ) -> AsyncIterator[Event]:
        spec = build_eval_spec(instance)  # bad input fails the call before anything streams
        started = time.monotonic()
        report = Report(instance_id=str(instance["instance_id"]))
        own_sandbox = not sandbox_id
        report.network = self._network
        report.package_index = self._package_index
        work: Path | None = None
        # Bad requests fail before the first message (the contract): check the sandbox or the
        # image reference up front, before PREPARE is announced.
        image = str(instance.get("image_name") or "")
        if own_sandbox:
            if not image:
                raise InvalidInstance(
                    "no sandbox_id and no instance.image_name to create one from",
                    instance_id=report.instance_id,
                )
            validate_image_reference(image)
        else:
            # NOT_FOUND for an unknown sandbox; a pool's sandbox has the network it was made with.
            report.network = self._m.get(sandbox_id).network
        try:
            yield PhaseEvent("PREPARE", time.time())
            if own_sandbox:
                t = time.monotonic()
                try:
                    record = await self._m.create(
                        CreateSpec(
                            image=image,
                            workdir=REPO_DIR,
                            owner="evaluate",
                            instance_id=report.instance_id,
                            network=self._network,
                            for_evaluation=True,
                            # Outlives the evaluation, but never past the node's longest
                            # lifetime (a longer ttl is refused as INVALID_SANDBOX_SPEC).
                            ttl_s=min(
                                (timeout_s or DEFAULT_EVALUATION_TIMEOUT_S) + 600,
                                self._m.settings.max_ttl_s,
                            ),
                        )
                    )
                except SwerlError as exc:
                    if isinstance(exc, InvalidArgument):
                        raise
                    yield self._infra(report, started, "PREPARE", exc.reason, exc.message)
                    return
                sandbox_id = record.sandbox_id
                report.sandbox_s = time.monotonic() - t
            work = self._m.io_dir(sandbox_id) / f"eval-{uuid.uuid4().hex[:12]}"
            work.mkdir(parents=True)
            inside = f"{CONTAINER_IO_DIR}/{work.name}"
            async for event in self._run(
                spec,
                patch,
                sandbox_id,
                work,
                inside,
                report,
                timeout_s or DEFAULT_EVALUATION_TIMEOUT_S,
                omit_logs,
            ):
                yield event
        finally:
            if work is not None:
                shutil.rmtree(work, ignore_errors=True)
            if own_sandbox and sandbox_id:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._m.destroy(sandbox_id))
        report.total_s = time.monotonic() - started
        log.info(
            "evaluate.done",
            instance_id=report.instance_id,
            status=report.status,
            total_s=round(report.total_s, 3),
            tests_s=round(report.tests_s, 3),
        )
        yield report

    def _infra(
        self, report: Report, started: float, phase: str, reason: str, message: str
    ) -> Report:
        _stop(report, "INFRA_ERROR", reason, message, phase)
        report.total_s = time.monotonic() - started
        return report

    async def _cmd(
        self,
        sandbox_id: str,
        command: str,
        *,
        phase: str,
        timeout_s: float,
        omit_logs: bool,
        sink: list[LogEvent],
        max_output: int = 1 << 20,
    ) -> tuple[Exit, bytes]:
        """Runs one harness command (stderr merged into stdout) and collects its output."""
        try:
            run = self._m.start_command(
                sandbox_id,
                CommandSpec(
                    f"exec 2>&1\n{command}", timeout_s=timeout_s, max_output_bytes=max_output
                ),
            )
        except SwerlError as exc:
            raise CommandFailed(exc.message, exc.reason) from exc
        out = bytearray()
        finished = False
        try:
            async for event in run.events():
                if isinstance(event, Output):
                    out += event.data
                    if not omit_logs:
                        sink.append(LogEvent(phase, STDOUT, event.data))
                elif isinstance(event, Exit):
                    finished = True
                    return event, bytes(out)
        except SwerlError as exc:
            raise CommandFailed(exc.message, exc.reason) from exc
        finally:
            if not finished:
                run.abandon()
        raise CommandFailed("the command ended without an exit status")

    async def _run(
        self,
        spec: EvalSpec,
        patch: bytes,
        sandbox_id: str,
        work: Path,
        inside: str,
        report: Report,
        timeout_s: float,
        omit_logs: bool,
    ) -> AsyncIterator[Event]:
        logs: list[LogEvent] = []

        def flush() -> list[LogEvent]:
            out = list(logs)
            logs.clear()
            return out

        async def step(command: str, phase: str, timeout: float = 300.0, max_output: int = 1 << 20):
            return await self._cmd(
                sandbox_id,
                command,
                phase=phase,
                timeout_s=timeout,
                omit_logs=omit_logs,
                sink=logs,
                max_output=max_output,
            )

        try:
            # -- the candidate patch ---------------------------------------------------------
            yield PhaseEvent("APPLY_PATCH", time.time())
            t = time.monotonic()
            verdict = empty_patch(patch)
            if verdict is not None:
                _stop(report, verdict.status, verdict.reason, verdict.message, verdict.phase)
                return
            (work / "model.patch").write_bytes(patch if patch.endswith(b"\n") else patch + b"\n")
            p = f"{inside}/model.patch"
            attempts = [
                ("GIT_APPLY", f"git apply --verbose {p}"),
                ("GIT_APPLY_3WAY", f"git apply --verbose --3way {p}"),
                ("GIT_APPLY_REJECT", f"git apply --verbose --reject {p}"),
                ("PATCH_FUZZ", f"patch --batch --fuzz=5 -p1 -i {p}"),
            ]
            first_error = b""
            for method, command in attempts:
                result, output = await step(f"cd {REPO_DIR} && {command}", "APPLY_PATCH")
                if result.exit_code == 0:
                    report.patch_applied, report.apply_method = True, method
                    break
                first_error = first_error or output
                # Back to a clean tree at the base commit before the next method. A failed plain
                # `git apply` is atomic (it changed nothing), and after the last method there is
                # no next one.
                if method != "GIT_APPLY" and method != attempts[-1][0]:
                    await step(
                        f"cd {REPO_DIR} && git reset --hard -q HEAD && git clean -fdq",
                        "APPLY_PATCH",
                    )
            for event in flush():
                yield event
            report.apply_s = time.monotonic() - t
            if not report.patch_applied:
                _stop(report, "PATCH_FAILED", "PATCH_APPLY_FAILED", first_error, "APPLY_PATCH")
                return

            # -- the test patch (files it touches restored to the base commit first) ---------
            if spec.test_patch.strip() and not spec.applies_test_patch_itself:
                yield PhaseEvent("APPLY_TEST_PATCH", time.time())
                (work / "test.patch").write_text(
                    spec.test_patch if spec.test_patch.endswith("\n") else spec.test_patch + "\n"
                )
                paths = _patched_paths(spec.test_patch)
                restore = (
                    f'for f in {_shell_words(paths)}; do git checkout -q HEAD -- "$f" 2>/dev/null'
                    ' || rm -rf -- "$f"; done; '
                    if paths
                    else ""
                )
                result, output = await step(
                    f"cd {REPO_DIR} && {restore}git apply --verbose {inside}/test.patch",
                    "APPLY_TEST_PATCH",
                )
                for event in flush():
                    yield event
                if result.exit_code != 0:
                    _stop(report, "INFRA_ERROR", "TEST_PATCH_FAILED", output, "APPLY_TEST_PATCH")
                    return

            # -- the tests --------------------------------------------------------------------
            yield PhaseEvent("RUN_TESTS", time.time())
            (work / "eval.sh").write_text(_recording_exit_code(spec))
            offline = _OFFLINE_ENV if report.network == "none" else ""
            if self._package_index:
                offline += f"export PIP_INDEX_URL={_shell_words([self._package_index])}\n"
            if spec.prints_markers:
                # The script prints the markers (swebench's eval.sh, or a copy of it): a second
                # pair around it would frame its setup steps as test output.
                run_tests = f"{offline}cd {REPO_DIR} && bash {inside}/eval.sh"
            else:
                run_tests = (
                    f"{offline}cd {REPO_DIR}\necho '{START_MARKER}'\nbash {inside}/eval.sh\n"
                    f"rc=$?\necho '{END_MARKER}'\necho \"{EXIT_MARKER}: $rc\"\nexit $rc"
                )
            t = time.monotonic()
            result, test_log = await step(
                run_tests, "RUN_TESTS", timeout=timeout_s, max_output=MAX_LOG_BYTES
            )
            report.tests_s = time.monotonic() - t
            report.test_exit_code = _test_exit_code(test_log, result.exit_code)
            report.warnings.extend(log_warnings(test_log, report.network))
            for event in flush():
                yield event
            if result.timed_out:
                message = f"the tests ran past {timeout_s:g} s and were killed"
                _stop(report, "TIMEOUT", "TESTS_TIMED_OUT", message, "RUN_TESTS")
                return

            # -- grading ------------------------------------------------------------------------
            yield PhaseEvent("GRADE", time.time())
            t = time.monotonic()
            if spec.exit_code_only:
                report.status = "RESOLVED_FULL" if result.exit_code == 0 else "UNRESOLVED"
            else:
                await asyncio.to_thread(grade, spec, patch, test_log, report)
            report.grade_s = time.monotonic() - t
        except CommandFailed as exc:
            _stop(
                report,
                "INFRA_ERROR",
                exc.reason,
                str(exc),
                report.failed_phase or "RUN_TESTS",
            )


def _recording_exit_code(spec: EvalSpec) -> str:
    """The script as run: swebench's layout gets one line that prints the test command's exit code.

    swebench's eval.sh ends by restoring the test files, so its own exit status is that of a
    `git checkout`. Right after the test command (before the end marker) it records `$?`, and
    prints it after the marker, outside the section the grader parses. Other scripts run as
    written: the wrapper prints their exit status, or, if they print the markers themselves
    without swebench's closing line, their exit status is the script's.
    """
    lines = spec.eval_script.split("\n")
    if not spec.prints_markers or _SWEBENCH_END_LINE not in lines:
        return spec.eval_script
    at = lines.index(_SWEBENCH_END_LINE)
    return "\n".join(
        [
            *lines[:at],
            "swerl_test_exit_code=$?",
            lines[at],
            f'echo "{EXIT_MARKER}: $swerl_test_exit_code"',
            *lines[at + 1 :],
        ]
    )


def _test_exit_code(test_log: bytes, script_exit_code: int) -> int:
    """The last exit code the log records for the test command, else the script's own."""
    codes = _EXIT_LINE.findall(test_log)
    return int(codes[-1]) if codes else script_exit_code


def log_warnings(test_log: bytes, network: str) -> list[EvalWarning]:
    """What the log shows failed without deciding the verdict: an install step, a network step.

    An install step failed when a `pip install` the script traced (`set -x`) is followed, before
    the next traced command, by pip's `ERROR:` or a sign that there is no pip to run. A network
    step failed when any line shows a connection or name-resolution failure, or pip finding no
    distribution.
    """
    warnings: list[EvalWarning] = []
    for match in _INSTALL_TRACE.finditer(test_log):
        after = test_log[match.end() :]
        next_trace = re.search(rb"^\+ ", after, re.MULTILINE)
        section = after[: next_trace.start()] if next_trace else after
        error = _INSTALL_FAILURE.search(section)
        if error:
            step = match.group().decode(errors="replace")[2:]
            detail = error.group().decode(errors="replace").strip()
            message = f"`{step}` failed: {detail}"[:500]
            warnings.append(EvalWarning(reason="INSTALL_STEP_FAILED", message=message))
    failure = _NETWORK_FAILURES.search(test_log)
    if failure:
        start = test_log.rfind(b"\n", 0, failure.start()) + 1
        end = test_log.find(b"\n", failure.end())
        line = test_log[start : end if end >= 0 else None].decode(errors="replace").strip()
        where = "without network" if network == "none" else f"with network {network!r}"
        message = f"a step needed the network ({where}): {line}"[:500]
        warnings.append(EvalWarning(reason="NETWORK_STEP_FAILED", message=message))
    return warnings


def _stop(report: Report, status: str, reason: str, message: str | bytes, phase: str = "") -> None:
    """Ends the report early: its verdict, why (the tail of `message`), and the phase it was in.

    An empty `phase` leaves failed_phase as it is.
    """
    if isinstance(message, bytes):
        message = message.decode(errors="replace")
    report.status = status
    report.error_reason = reason
    report.error_message = message[-2000:]
    if phase:
        report.failed_phase = phase


def grade(spec: EvalSpec, patch: bytes, test_log: bytes, report: Report) -> None:
    """swebench's own report for this log; fills the verdict and test lists of `report`."""
    from swebench.harness.grading import get_eval_report, get_resolution_status

    with tempfile.NamedTemporaryFile("wb", suffix=".log") as handle:
        # swebench reads the log as text in the default encoding; bytes that are not UTF-8
        # (tests print anything) would make it raise instead of grading.
        handle.write(test_log.decode("utf-8", errors="replace").encode("utf-8"))
        handle.flush()
        prediction = {
            "instance_id": report.instance_id,
            "model_name_or_path": "swerl",
            "model_patch": patch.decode(errors="replace"),
        }
        result = get_eval_report(spec.test_spec, prediction, handle.name, True)[report.instance_id]
    tests = result.get("tests_status")
    if not tests:
        message = "the test log has no parseable results (did the tests run?)"
        _stop(report, "UNRESOLVED", "NO_TEST_RESULTS", message, "GRADE")
        return
    report.f2p_success = list(tests["FAIL_TO_PASS"]["success"])
    report.f2p_failure = list(tests["FAIL_TO_PASS"]["failure"])
    report.p2p_success = list(tests["PASS_TO_PASS"]["success"])
    report.p2p_failure = list(tests["PASS_TO_PASS"]["failure"])
    resolution = get_resolution_status(tests)
    report.status = {
        "RESOLVED_FULL": "RESOLVED_FULL",
        "RESOLVED_PARTIAL": "RESOLVED_PARTIAL",
    }.get(resolution, "UNRESOLVED")
