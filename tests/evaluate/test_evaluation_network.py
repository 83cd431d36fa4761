"""The evaluation network: off by default, an operator's node setting turns it on for the
sandboxes Evaluate creates (never for agent sandboxes), every report says which, and a log
that shows a failed install or network step is flagged without changing the verdict.

No test here sends traffic anywhere: the sandboxes only list their network interfaces.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest
from evaluate_testkit import TASKS, TOKEN, EvalNode, evaluate, task_instance
from exec_testkit import assert_status

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
