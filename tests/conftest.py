"""Fixtures shared by every test (real dockerd and the base image, the harness bundles, grpcurl)
and the hooks of the whole run: the `docker` marker, progress lines, task stacks of a hung test."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import threading

import pytest
from testkit.docker import mark_docker_tests

BASE_IMAGE = os.environ.get("SWERL_BASE_IMAGE", "swerl-base:bookworm")


def _docker_ready() -> str | None:
    if shutil.which("docker") is None:
        return "docker CLI not installed (run deploy/docker-up.sh)"
    probe = subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True)
    if probe.returncode != 0:
        return f"dockerd or {BASE_IMAGE} missing (run deploy/docker-up.sh)"
    return None


@pytest.fixture(scope="session")
def base_image() -> str:
    """The base image on a ready dockerd, and the bundled example tasks' images built on it
    (the episodes of the agent, plugin and soak tests lease them; a new machine has none, and
    an image already present is kept, so this costs seconds once)."""
    problem = _docker_ready()
    if problem:
        # CI runs deploy/docker-up.sh first; a missing Docker there is a failure, not a skip.
        pytest.fail(problem)
    from swerl.tasks import build_images, default_tasks_dir, load_tasks

    build_images(load_tasks(default_tasks_dir()), base_image=BASE_IMAGE, progress=lambda _: None)
    return BASE_IMAGE


@pytest.fixture(scope="session")
def grpcurl_bin(tmp_path_factory: pytest.TempPathFactory) -> str:
    """grpcurl from PATH, else installed into a temp dir (testkit.grpcurl); a failure without."""
    from testkit.grpcurl import find_or_install_grpcurl

    return find_or_install_grpcurl(tmp_path_factory)


@pytest.fixture(scope="session")
def harness_bundle_dir():
    """A harness bundle directory holding the default claude-code bundle (swerl.exec.bundles),
    built once and kept between runs (SWERL_EXEC_HARNESS_BUNDLE_DIR, default the local stack's
    ~/.cache/swerl-bundles): the Node wheel and the npm package are downloaded on the first run
    only."""
    from swerl.exec.bundles import HARNESS_PACKAGES, HarnessBundles
    from swerl.stack import local_bundle_dir

    root = local_bundle_dir()
    package = HARNESS_PACKAGES["claude-code"]
    HarnessBundles(root).build_blocking(package, package.default_version)
    return root


# -- logging set by one test does not reach the next ---------------------------------------------
# A test that runs a CLI in-process (`swerl eval` quiets swerl's logs to warnings) leaves
# structlog configured so; a later test of the same process that captures info lines
# (structlog.testing.capture_logs) would then see none. Which tests share a process depends on
# the order and on the pytest-xdist worker, so each test gets back the configuration it found.
@pytest.fixture(autouse=True)
def _engine_turn(request: pytest.FixtureRequest):
    """A test that uses the run's vLLM engine holds it for its duration: shared, or alone when
    marked `vllm_alone` (testkit.vllm_engine.engine_turn)."""
    if "vllm_engine" not in request.fixturenames:
        yield
        return
    from testkit.vllm_engine import engine_turn

    with engine_turn(alone=request.node.get_closest_marker("vllm_alone") is not None):
        yield


@pytest.fixture(autouse=True)
def _structlog_configuration_restored():
    import logging

    import structlog

    saved, root_level = structlog.get_config(), logging.getLogger().level
    yield
    structlog.configure(**saved)
    logging.getLogger().setLevel(root_level)


# -- which tests need dockerd ------------------------------------------------------------------
# Every test whose fixtures need dockerd is marked `docker` (testkit.docker names the fixtures),
# so `pytest -m "not docker"` runs without one. First, so that `-m` sees the markers.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_docker_tests(items)


# -- what a run that dies tells --------------------------------------------------------------
# A process that dies of a signal (a crash in native code, the OOM killer) prints no summary: the
# failures before it and the test it died in would be lost. With SWERL_TEST_PROGRESS set to a
# file, each test is written there as it starts and each failure as it is reported, so
# scripts/test can say what happened (it sets the variable and prints the file on such a death).
_PROGRESS = os.environ.get("SWERL_TEST_PROGRESS", "")


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist the workers run the tests and write the file (a hung test's task stacks
    # exist only in its worker); the controller sees every report again and writes nothing.
    global _PROGRESS
    is_worker = "PYTEST_XDIST_WORKER" in os.environ
    if getattr(config.option, "numprocesses", None) and not is_worker:
        _PROGRESS = ""


def _progress(line: str) -> None:
    with open(_PROGRESS, "a", encoding="utf-8") as out:
        out.write(line + "\n")


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    if _PROGRESS:
        _progress(f"started {nodeid}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _PROGRESS and report.failed:
        _progress(f"FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}")
        if report.nodeid in _TASKS_DUMPED:
            _progress(_TASKS_DUMPED.pop(report.nodeid))


# -- what a test that hangs was waiting for ----------------------------------------------------
# pytest-timeout shows where the main thread is; in an async test that is the event loop's
# select(), which says nothing of the coroutine that never finished. So shortly before the
# timeout, the stack of every task of every running event loop is written to stderr (and kept
# for the progress file): the hung await is in there.
_TASKS_DUMPED: dict[str, str] = {}
_DUMP_BEFORE_TIMEOUT_S = 15.0


def _task_stacks() -> str:
    import asyncio
    import io

    out = io.StringIO()
    loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)]
    for loop in loops:
        if not loop.is_running():
            continue
        try:
            tasks = asyncio.all_tasks(loop)
        except RuntimeError as exc:  # the loop changed its tasks under us; say so, go on
            out.write(f"(tasks of {loop!r} could not be listed: {exc})\n")
            continue
        for task in tasks:
            out.write(f"-- {task!r}\n")
            try:
                task.print_stack(limit=30, file=out)
            except Exception as exc:  # a task finishing under us
                out.write(f"   (stack unavailable: {exc})\n")
    return out.getvalue() or "(no running event loop)\n"


def _dump_tasks(nodeid: str, after_s: float) -> None:
    text = f"TASKS of {nodeid}, still running after {after_s:g} s (the event loops' tasks):\n"
    text += _task_stacks()
    _TASKS_DUMPED[nodeid] = text
    sys.__stderr__.write(text)
    sys.__stderr__.flush()


def _timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    try:
        return float(item.config.getini("timeout") or 0)
    except (ValueError, KeyError):
        return 0.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    timeout = _timeout_of(item)
    timer = None
    if timeout > 2 * _DUMP_BEFORE_TIMEOUT_S:
        after = timeout - _DUMP_BEFORE_TIMEOUT_S
        timer = threading.Timer(after, _dump_tasks, args=(item.nodeid, after))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
