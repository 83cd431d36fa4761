"""swerl.exec.client's deadlines and lease wiring, read on the server side of a real gRPC call.

A stand-in node (a real grpc.aio server on port 0 whose servicers only record what each call
brought: its deadline and metadata) answers the client; no dockerd. The deadlines asserted are
the ones callers had in effect before the client owned them (the agent's GetDiff 120 s,
OpenHarness 900 s and Evaluate tests + 120 s; `swerl validate`'s tests + 300 s; the look-ups'
60 s), and each is the node's own bound where the node has one (swerl.exec.settings).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
from google.protobuf import timestamp_pb2

from swerl.chassis.capability import LEASE_TOKEN_METADATA_KEY
from swerl.chassis.client import make_channel
from swerl.exec.client import SandboxClient
from swerl.exec.settings import (
    DEFAULT_EVALUATION_TIMEOUT_S,
    DEFAULT_SANDBOX_TTL_S,
    DIFF_TIMEOUT_S,
    HARNESS_BUILD_STEP_TIMEOUT_S,
    ExecSettings,
)
from swerl.exec.v1 import evaluate_pb2, evaluate_pb2_grpc, sandbox_pb2_grpc
from swerl.exec.v1 import sandbox_pb2 as pb

# How far a recorded deadline may sit below the one set (the call's way to the server), and
# above it (gRPC core sends a timeout rounded up, to the next 10 s for an hour).
SLACK_S = 5.0
ROUNDING_S = 10.0


@dataclass
class Seen:
    """What the stand-in node saw of each call, by method name."""

    deadline_s: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    requests: dict[str, list[object]] = field(default_factory=dict)
    expire_time: float = 0.0

    def record(self, method: str, context: grpc.aio.ServicerContext, request: object) -> None:
        remaining = context.time_remaining()
        self.deadline_s[method] = float("inf") if remaining is None else remaining
        pairs = {key: value for key, value in context.invocation_metadata() or ()}
        self.metadata.setdefault(method, []).append(pairs)
        self.requests.setdefault(method, []).append(request)


def _timestamp(epoch_s: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(epoch_s * 1e9))
    return stamp


class StandInSandboxes(sandbox_pb2_grpc.SandboxServiceServicer):
    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    def _sandbox(self, sandbox_id: str) -> pb.Sandbox:
        return pb.Sandbox(sandbox_id=sandbox_id, expire_time=_timestamp(self.seen.expire_time))

    async def CreateSandbox(self, request, context):
        self.seen.record("CreateSandbox", context, request)
        return pb.CreateSandboxResponse(sandbox=self._sandbox("sbx-new"))

    async def DestroySandbox(self, request, context):
        self.seen.record("DestroySandbox", context, request)
        return pb.DestroySandboxResponse(existed=True)

    async def GetSandbox(self, request, context):
        self.seen.record("GetSandbox", context, request)
        return pb.GetSandboxResponse(sandbox=self._sandbox(request.sandbox_id))

    async def RenewSandbox(self, request, context):
        self.seen.record("RenewSandbox", context, request)
        self.seen.expire_time = time.time() + request.ttl.ToTimedelta().total_seconds()
        return pb.RenewSandboxResponse(sandbox=self._sandbox(request.sandbox_id))

    async def GetDiff(self, request, context):
        self.seen.record("GetDiff", context, request)
        return pb.GetDiffResponse(patch=b"diff --git a/x b/x\n")

    async def OpenHarness(self, request, context):
        self.seen.record("OpenHarness", context, request)
        return pb.OpenHarnessResponse(bundle_dir="/opt/swerl/bundles/x")

    async def GetNodeInfo(self, request, context):
        self.seen.record("GetNodeInfo", context, request)
        return pb.GetNodeInfoResponse(node_id="stand-in")

    async def ListImages(self, request, context):
        self.seen.record("ListImages", context, request)
        return pb.ListImagesResponse(images=[pb.Image(repo_tags=["python:3.11"])])

    async def EnsureImages(self, request, context):
        self.seen.record("EnsureImages", context, request)
        for image in request.images:
            status = pb.IMAGE_PULL_STATUS_PRESENT
            yield pb.EnsureImagesResponse(result=pb.ImagePullResult(image=image, status=status))

    async def ExecCommands(self, request_iterator, context):
        async for request in request_iterator:
            if request.WhichOneof("kind") == "start":
                self.seen.record("ExecCommands", context, request)
                yield pb.ExecCommandsResponse(exit=pb.ExecExit(exit_code=0))


class StandInEvaluations(evaluate_pb2_grpc.EvaluateServiceServicer):
    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    async def Evaluate(self, request, context):
        self.seen.record("Evaluate", context, request)
        report = evaluate_pb2.EvaluationReport(status=evaluate_pb2.EVALUATION_STATUS_UNRESOLVED)
        yield evaluate_pb2.EvaluateResponse(report=report)


@pytest.fixture
async def stand_in() -> AsyncIterator[tuple[str, Seen]]:
    seen = Seen()
    server = grpc.aio.server()
    sandbox_pb2_grpc.add_SandboxServiceServicer_to_server(StandInSandboxes(seen), server)
    evaluate_pb2_grpc.add_EvaluateServiceServicer_to_server(StandInEvaluations(seen), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", seen
    finally:
        await server.stop(0)


@pytest.fixture
async def client(stand_in) -> AsyncIterator[SandboxClient]:
    address, _ = stand_in
    channel = make_channel(address)
    node = SandboxClient(channel)
    try:
        yield node
    finally:
        await node.aclose()
        await channel.close()


def assert_deadline(seen: Seen, method: str, expected_s: float) -> None:
    got = seen.deadline_s[method]
    assert expected_s - SLACK_S < got <= expected_s + ROUNDING_S, f"{method}: {got:.1f} s"


async def test_get_diff_waits_as_long_as_the_node_lets_the_diff_script_run(stand_in, client):
    _, seen = stand_in
    response = await client.diff("sbx-1")
    assert response.patch.startswith(b"diff --git")
    assert DIFF_TIMEOUT_S == 120.0  # the agent's GetDiff deadline before the client owned it
    assert_deadline(seen, "GetDiff", DIFF_TIMEOUT_S)
    (request,) = seen.requests["GetDiff"]
    assert (request.sandbox_id, request.include_untracked) == ("sbx-1", True)


async def test_open_harness_waits_for_one_bundle_build_step(stand_in, client):
    _, seen = stand_in
    opened = await client.open_harness(
        "sbx-1", "claude-code", gateway_url="http://gw:1/s/x", gateway_api_key="k"
    )
    assert opened.bundle_dir == "/opt/swerl/bundles/x"
    assert HARNESS_BUILD_STEP_TIMEOUT_S == 900.0  # the agent's OpenHarness deadline before
    assert_deadline(seen, "OpenHarness", HARNESS_BUILD_STEP_TIMEOUT_S)
    (request,) = seen.requests["OpenHarness"]
    assert (request.harness, request.gateway_url, request.gateway_api_key) == (
        "claude-code",
        "http://gw:1/s/x",
        "k",
    )


async def test_evaluate_in_a_held_sandbox_waits_for_the_tests_and_two_minutes(stand_in, client):
    _, seen = stand_in
    instance = evaluate_pb2.SweInstance(instance_id="i-1")
    report = await client.evaluation_report(instance, b"", sandbox_id="sbx-1", timeout_s=300)
    assert report is not None and report.status == evaluate_pb2.EVALUATION_STATUS_UNRESOLVED
    assert_deadline(seen, "Evaluate", 300 + 120)
    (request,) = seen.requests["Evaluate"]
    assert request.timeout.seconds == 300 and request.omit_logs and request.request_id


async def test_evaluate_in_the_nodes_own_sandbox_also_waits_for_that_sandbox(stand_in, client):
    _, seen = stand_in
    instance = evaluate_pb2.SweInstance(instance_id="i-1")
    await client.evaluation_report(instance, b"", timeout_s=600)
    assert_deadline(seen, "Evaluate", 600 + 300)  # `swerl validate`'s deadline before


async def test_evaluate_without_a_timeout_waits_for_the_nodes_default_one(stand_in, client):
    _, seen = stand_in
    await client.evaluation_report(evaluate_pb2.SweInstance(), b"", sandbox_id="sbx-1")
    assert_deadline(seen, "Evaluate", DEFAULT_EVALUATION_TIMEOUT_S + 120)
    (request,) = seen.requests["Evaluate"]
    assert not request.HasField("timeout")  # the node applies its own default


async def test_a_command_call_lives_as_long_as_a_default_sandbox(stand_in, client):
    _, seen = stand_in
    assert DEFAULT_SANDBOX_TTL_S == ExecSettings.model_fields["default_ttl_s"].default
    result = await client.run("sbx-1", "true", timeout_s=5)
    assert result.exit_code == 0
    assert_deadline(seen, "ExecCommands", DEFAULT_SANDBOX_TTL_S)


async def test_calls_the_node_does_not_bound_get_the_clients_timeout(stand_in, client):
    _, seen = stand_in
    created = await client.create_sandbox("python:3.11", workdir="/w", env={"A": "1"})
    assert created.sandbox_id == "sbx-new"
    assert await client.destroy_sandbox("sbx-new")
    assert (await client.node_info()).node_id == "stand-in"
    assert [list(i.repo_tags) for i in await client.list_images()] == [["python:3.11"]]
    for method in ("CreateSandbox", "DestroySandbox", "GetNodeInfo", "ListImages"):
        assert_deadline(seen, method, 60.0)
    (request,) = seen.requests["CreateSandbox"]
    assert (request.image, request.workdir, dict(request.env)) == ("python:3.11", "/w", {"A": "1"})
    assert request.request_id and not request.HasField("ttl")


async def test_ensure_images_streams_one_result_per_image_within_an_hour(stand_in, client):
    _, seen = stand_in
    results = [r.result.image async for r in client.ensure_images(["a:1", "b:2"])]
    assert results == ["a:1", "b:2"]
    assert_deadline(seen, "EnsureImages", 3600.0)  # `swerl images pull`'s deadline before


async def test_holding_a_sandbox_renews_it_only_when_its_expiry_is_sooner(stand_in, client):
    _, seen = stand_in
    seen.expire_time = time.time() + 1000
    expire = await client.hold_sandbox("sbx-1", 60)
    assert expire == pytest.approx(seen.expire_time, abs=1e-3)
    assert "RenewSandbox" not in seen.requests  # never shortened
    seen.expire_time = time.time() + 10
    expire = await client.hold_sandbox("sbx-1", 60)
    assert expire == pytest.approx(time.time() + 60, abs=2)
    (renew,) = seen.requests["RenewSandbox"]
    assert renew.ttl.seconds == 60 and renew.request_id
    assert_deadline(seen, "RenewSandbox", 5.0)


@dataclass
class HeldLease:
    """A lease as `SandboxClient.for_lease` reads one (swerl.pool.client.Lease's fields)."""

    node_address: str
    token: str
    auth_token: str | None = "bearer-1"
    tls_ca_file: str | None = None
    attached: list[SandboxClient] = field(default_factory=list)

    def attach_node(self, node: SandboxClient) -> None:
        self.attached.append(node)


async def test_a_lease_client_sends_the_leases_current_token_and_closes_its_channel(stand_in):
    address, seen = stand_in
    lease = HeldLease(address, token="cap-1")
    node = SandboxClient.for_lease(lease)
    assert lease.attached == [node]
    await node.diff("sbx-1")
    lease.token = "cap-2"  # renewed by the pool's KeepAlive
    await node.diff("sbx-1")
    sent = [(m[LEASE_TOKEN_METADATA_KEY], m["authorization"]) for m in seen.metadata["GetDiff"]]
    assert sent == [("cap-1", "Bearer bearer-1"), ("cap-2", "Bearer bearer-1")]
    await node.aclose()
    with pytest.raises(grpc.aio.UsageError):
        await node.diff("sbx-1")  # its channel is closed with it
