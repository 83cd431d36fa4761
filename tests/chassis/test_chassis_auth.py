"""Bearer-token auth at the boundary: required by default, health exempt, reflection not."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc
from pydantic import ValidationError
from testkit.chassis import TOKEN, ChassisTestSettings

from swerl.chassis.client import error_info, make_channel
from swerl.exec.v1 import sandbox_pb2, sandbox_pb2_grpc


async def _get_node_info(address: str, metadata: tuple = ()) -> sandbox_pb2.GetNodeInfoResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        return await stub.GetNodeInfo(
            sandbox_pb2.GetNodeInfoRequest(), metadata=metadata, timeout=5
        )


async def test_call_without_token_is_unauthenticated_missing_token(server):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _get_node_info(server.address)

    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_info(caught.value)[0] == "MISSING_TOKEN"


async def test_call_with_wrong_token_is_unauthenticated_invalid_token(server):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _get_node_info(server.address, (("authorization", "Bearer not-the-token"),))

    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_info(caught.value)[0] == "INVALID_TOKEN"


async def test_token_without_bearer_scheme_is_invalid_token(server):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _get_node_info(server.address, (("authorization", TOKEN),))

    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_info(caught.value)[0] == "INVALID_TOKEN"


async def test_call_with_the_right_token_succeeds(server):
    response = await _get_node_info(server.address, (("authorization", f"Bearer {TOKEN}"),))

    assert response.node_id  # The request id the handler saw.


async def test_health_check_needs_no_token(server):
    async with grpc.aio.insecure_channel(server.address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )

    assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_needs_a_token(server):
    # The refusal answers the call's headers, before any request: the call writes none. A request
    # written meanwhile races the refusal in gRPC's asyncio client, whose failed write sets the
    # call's own status (INTERNAL "Internal error from Core") when it beats the server's (seen
    # in CI under load); the server's answer is what this test is about.
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()

    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_info(caught.value)[0] == "MISSING_TOKEN"


async def test_insecure_server_accepts_calls_without_token(make_server):
    server = await make_server(auth_token=None, insecure=True)

    response = await _get_node_info(server.address)

    assert response.node_id


async def test_make_channel_sends_the_token(server):
    async with make_channel(server.address, token=TOKEN) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        response = await stub.GetNodeInfo(sandbox_pb2.GetNodeInfoRequest(), timeout=5)

    assert response.node_id


def test_server_without_token_refuses_to_start_unless_insecure(monkeypatch):
    monkeypatch.delenv("SWERL_CHASSIS_TEST_AUTH_TOKEN", raising=False)

    with pytest.raises(ValidationError, match="auth_token is required"):
        ChassisTestSettings()


def test_empty_token_counts_as_no_token(monkeypatch):
    monkeypatch.setenv("SWERL_CHASSIS_TEST_AUTH_TOKEN", "")

    with pytest.raises(ValidationError, match="SWERL_CHASSIS_TEST_AUTH_TOKEN"):
        ChassisTestSettings()
