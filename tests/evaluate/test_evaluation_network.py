"""The evaluation network: off by default, an operator's node setting turns it on for the
sandboxes Evaluate creates (never for agent sandboxes), every report says which, and a log
that shows a failed install or network step is flagged without changing the verdict.

Traffic stays on loopback: the sandboxes list their network interfaces, and the network task
(examples/network-tasks) fetches its data file either from a `.invalid` host (offline: nothing
resolves, nothing is sent) or from an HTTP server the test starts on 127.0.0.1, reached through
the node's test-only `evaluation_host_network_test_only`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from testkit.evaluate import (
    NETWORK_TASKS,
    NETWORK_TASKS_DIR,
    TASKS,
    TOKEN,
    EvalNode,
    evaluate,
    task_instance,
)
from testkit.exec import assert_status

from swerl.cli import main
from swerl.exec.evaluate import log_warnings
from swerl.exec.server import ExecNode
from swerl.exec.settings import ExecSettings
from swerl.exec.v1 import sandbox_pb2

ROMANS = "swerl-examples__romans-5"
# Lists the sandbox's interfaces, then runs the task's own tests.
INTERFACES_THEN_TESTS = (
    "echo interfaces: $(ls /sys/class/net | sort | tr '\\n' ' ')\n" + TASKS[ROMANS].eval_script
)


@contextlib.asynccontextmanager
async def _node(tmp_path, **settings_changes) -> AsyncIterator[EvalNode]:
    """A running node whose settings differ from the tests' defaults by `settings_changes`."""
    settings = ExecSettings(
        host="127.0.0.1",
        port=0,
        auth_token=TOKEN,
        node_id="test-evalnet-" + uuid.uuid4().hex[:8],
        state_dir=tmp_path / "state",
        default_memory_bytes=512 << 20,
        default_pids=256,
        drain_grace_s=1.0,
        **settings_changes,
    )
    node = ExecNode(settings)
    await node.start()
    running = EvalNode(node)
    try:
        yield running
    finally:
        await running.channel.close()
        await node.stop(0)


MIRROR = "http://127.0.0.1:9/simple"


@pytest.fixture
async def networked_node(tmp_path, task_images):
    async with _node(tmp_path, evaluation_network=True) as running:
        yield running


@pytest.fixture
async def mirrored_node(tmp_path, task_images):
    async with _node(tmp_path, evaluation_package_index=MIRROR) as running:
        yield running


def _interfaces(log: bytes) -> list[str]:
    line = next(x for x in log.decode().splitlines() if x.startswith("interfaces:"))
    return line.split()[1:]


@pytest.mark.docker
async def test_evaluation_is_offline_by_default_and_the_report_says_so(eval_node):
    instance = task_instance(ROMANS, eval_script=INTERFACES_THEN_TESTS)
    evaluation = await evaluate(eval_node.evaluate, instance, TASKS[ROMANS].gold_patch)
    assert evaluation.status == "RESOLVED_FULL"
    assert evaluation.report.network == sandbox_pb2.NETWORK_MODE_NONE
    assert _interfaces(evaluation.log_of("RUN_TESTS")) == ["lo"]


@pytest.mark.docker
async def test_the_operator_setting_gives_evaluation_sandboxes_the_bridge_network(
    networked_node,
):
    instance = task_instance(ROMANS, eval_script=INTERFACES_THEN_TESTS)
    evaluation = await evaluate(networked_node.evaluate, instance, TASKS[ROMANS].gold_patch)
    assert evaluation.status == "RESOLVED_FULL"
    assert evaluation.report.network == sandbox_pb2.NETWORK_MODE_BRIDGE
    assert "eth0" in _interfaces(evaluation.log_of("RUN_TESTS"))


@pytest.mark.docker
async def test_the_evaluation_network_setting_gives_agent_sandboxes_no_network(networked_node):
    request = sandbox_pb2.CreateSandboxRequest(
        request_id=uuid.uuid4().hex,
        image=TASKS[ROMANS].image_name,
        network=sandbox_pb2.NETWORK_MODE_BRIDGE,
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await networked_node.sandboxes.CreateSandbox(request, timeout=60)
    assert_status(info.value, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_SANDBOX_SPEC")


PIP_ENV = "echo pip-env: ${PIP_INDEX_URL:-default} ${PIP_RETRIES:-unset}\n"


def _pip_env(log: bytes) -> list[str]:
    line = next(x for x in log.decode().splitlines() if x.startswith("pip-env:"))
    return line.split()[1:]


@pytest.mark.docker
async def test_offline_pip_does_not_retry_and_a_named_mirror_is_used_and_reported(
    eval_node, mirrored_node
):
    instance = task_instance(ROMANS, eval_script=PIP_ENV + TASKS[ROMANS].eval_script)
    plain = await evaluate(eval_node.evaluate, instance, TASKS[ROMANS].gold_patch)
    assert _pip_env(plain.log_of("RUN_TESTS")) == ["default", "0"]
    assert plain.report.package_index == ""
    mirrored = await evaluate(mirrored_node.evaluate, instance, TASKS[ROMANS].gold_patch)
    assert _pip_env(mirrored.log_of("RUN_TESTS")) == [MIRROR, "0"]
    assert mirrored.report.package_index == MIRROR
    assert mirrored.status == "RESOLVED_FULL"


# Lines as pip and urllib print them when the sandbox has no network.
OFFLINE_INSTALL_LOG = b"""\
+ python -m pip install -e .
Obtaining file:///testbed
  Installing build dependencies: started
  WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after \
connection broken by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPSConnection \
object at 0x7f>: Failed to establish a new connection: [Errno 101] Network is unreachable')'
  ERROR: Could not find a version that satisfies the requirement setuptools>=40.8.0
  ERROR: No matching distribution found for setuptools>=40.8.0
+ git checkout abc tests/test_x.py
: '>>>>> Start Test Output'
tests/test_x.py::test_a PASSED
"""
OFFLINE_TEST_LOG = b"""\
+ pytest -rA tests/test_io.py
urllib.error.URLError: <urlopen error [Errno -3] Temporary failure in name resolution>
FAILED tests/test_io.py::test_read_remote - urllib.error.URLError
"""


def test_a_failed_offline_install_is_flagged_as_install_and_network_steps():
    warnings = log_warnings(OFFLINE_INSTALL_LOG, "none")
    assert [w.reason for w in warnings] == ["INSTALL_STEP_FAILED", "NETWORK_STEP_FAILED"]
    assert "`python -m pip install -e .` failed" in warnings[0].message
    assert "without network" in warnings[1].message


def test_a_test_that_needs_the_network_is_flagged():
    (warning,) = log_warnings(OFFLINE_TEST_LOG, "bridge")
    assert warning.reason == "NETWORK_STEP_FAILED"
    assert "Temporary failure in name resolution" in warning.message
    assert "with network 'bridge'" in warning.message


def test_a_clean_log_has_no_warnings():
    clean = b"+ python -m pip install -e .\nSuccessfully installed romans-0.1.0\n+ pytest -rA\n"
    assert log_warnings(clean, "none") == []


# -- a task whose test downloads its data over HTTP (examples/network-tasks) ------------------
TABFETCH = NETWORK_TASKS["swerl-examples__tabfetch-3"]
UNRELATED_PATCH = (
    "diff --git a/NOTES b/NOTES\nnew file mode 100644\n--- /dev/null\n+++ b/NOTES\n"
    "@@ -0,0 +1 @@\n+unrelated\n"
)


class _DataServer(ThreadingHTTPServer):
    """Serves a task's data/ directory on 127.0.0.1 and records who asked for what."""

    def __init__(self, directory: str) -> None:
        self.requests: list[tuple[str, str]] = []
        handler = functools.partial(_RecordingHandler, directory=directory)
        super().__init__(("127.0.0.1", 0), handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _RecordingHandler(SimpleHTTPRequestHandler):
    server: _DataServer

    def do_GET(self) -> None:
        self.server.requests.append((self.client_address[0], self.path))
        super().do_GET()

    def log_message(self, format: str, *args: object) -> None:
        pass  # the requests are asserted, not printed


@pytest.fixture
def data_server() -> Iterator[_DataServer]:
    server = _DataServer(str(TABFETCH.directory / "data"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
async def loopback_node(tmp_path, network_task_images):
    async with _node(tmp_path, evaluation_host_network_test_only=True) as running:
        yield running


def _served_from(server: _DataServer) -> dict:
    """The task's row with its eval script pointed at `server` (the variable it documents)."""
    row = dict(TABFETCH.instance)
    row["eval_script"] = f"export SWERL_EXAMPLE_DATA_URL={server.url}\n" + TABFETCH.eval_script
    return row


@pytest.mark.docker
async def test_offline_the_network_task_is_unresolved_and_the_network_step_is_flagged(
    eval_node, network_task_images
):
    evaluation = await evaluate(eval_node.evaluate, dict(TABFETCH.instance), TABFETCH.gold_patch)
    report = evaluation.report
    assert evaluation.status == "UNRESOLVED"
    assert report.network == sandbox_pb2.NETWORK_MODE_NONE
    assert list(report.fail_to_pass.failure) == TABFETCH.fail_to_pass
    assert sorted(report.pass_to_pass.success) == sorted(TABFETCH.pass_to_pass)
    (warning,) = report.warnings
    assert warning.reason == "NETWORK_STEP_FAILED"
    assert "without network" in warning.message
    # The line the warning quotes is the test's download failing to resolve the .invalid host.
    assert "Temporary failure in name resolution" in warning.message


@pytest.mark.docker
async def test_on_the_test_only_host_network_gold_fetches_from_loopback_and_resolves(
    loopback_node, data_server
):
    evaluation = await evaluate(
        loopback_node.evaluate, _served_from(data_server), TABFETCH.gold_patch
    )
    report = evaluation.report
    assert evaluation.status == "RESOLVED_FULL", report
    assert report.network == sandbox_pb2.NETWORK_MODE_HOST
    assert list(report.warnings) == []
    # The sandbox fetched the file, from loopback.
    assert data_server.requests == [("127.0.0.1", "/cities.tsv")]


@pytest.mark.docker
async def test_on_the_host_network_an_unfixed_tree_still_fails_the_fetch_test(
    loopback_node, data_server
):
    evaluation = await evaluate(loopback_node.evaluate, _served_from(data_server), UNRELATED_PATCH)
    assert evaluation.status == "UNRESOLVED"
    assert list(evaluation.report.fail_to_pass.failure) == TABFETCH.fail_to_pass
    assert list(evaluation.report.warnings) == []  # it reached the data: a verdict, not a warning
    assert data_server.requests == [("127.0.0.1", "/cities.tsv")]


@pytest.mark.docker
@pytest.mark.parametrize("node_kind", ["default", "host_network_test_only"])
async def test_agent_sandboxes_never_get_the_host_network(eval_node, loopback_node, node_kind):
    node = eval_node if node_kind == "default" else loopback_node
    request = sandbox_pb2.CreateSandboxRequest(
        request_id=uuid.uuid4().hex,
        image=TABFETCH.image_name,
        network=sandbox_pb2.NETWORK_MODE_HOST,
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await node.sandboxes.CreateSandbox(request, timeout=60)
    assert_status(info.value, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_SANDBOX_SPEC")


@pytest.mark.docker
def test_tasks_build_builds_the_network_task_set(network_task_images, capsys):
    # --rebuild runs the Dockerfile (from the build cache) and the base-commit check again.
    assert main(["tasks", "build", "--tasks", str(NETWORK_TASKS_DIR), "--rebuild"]) == 0
    assert "swerl-examples__tabfetch-3:latest: built in" in capsys.readouterr().out


@pytest.mark.docker
def test_validate_offline_reports_the_network_tasks_gold_as_needing_the_network(
    network_task_images, capsys
):
    assert main(["validate", "--tasks", str(NETWORK_TASKS_DIR), "--no-build"]) == 1
    out = capsys.readouterr().out
    assert "unpatched tree as the task says 1/1" in out
    assert "gold resolved 0/1" in out
    (gold,) = [
        line for line in out.splitlines() if line.startswith(TABFETCH.instance_id + "  gold ")
    ]
    assert "NETWORK_STEP_FAILED" in gold and "without network" in gold
