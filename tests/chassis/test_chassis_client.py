"""Client helpers and the retry policy, against real servers (and a port nobody listens on)."""

from __future__ import annotations

import socket
import time

import grpc
import pytest
from testkit.chassis import TOKEN, ChassisTestServicer

from swerl.chassis.client import error_info, make_channel
from swerl.chassis.interceptors import bound_request_id
from swerl.chassis.retry import async_retrying, idempotent_retry, is_retryable
from swerl.exec.v1 import sandbox_pb2, sandbox_pb2_grpc

FAST = {"initial_wait_s": 0.01, "max_wait_s": 0.02}


def _unused_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


async def test_bound_request_id_is_propagated_to_outgoing_calls(server):
    with bound_request_id("req-upstream"):
        async with make_channel(server.address, token=TOKEN) as channel:
            response = await sandbox_pb2_grpc.SandboxServiceStub(channel).GetNodeInfo(
                sandbox_pb2.GetNodeInfoRequest(), timeout=5
            )

    assert response.node_id == "req-upstream"


async def test_each_call_gets_a_fresh_request_id_outside_an_rpc(server):
    async with make_channel(server.address, token=TOKEN) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        first = await stub.GetNodeInfo(sandbox_pb2.GetNodeInfoRequest(), timeout=5)
        second = await stub.GetNodeInfo(sandbox_pb2.GetNodeInfoRequest(), timeout=5)

    assert first.node_id and second.node_id and first.node_id != second.node_id


async def test_error_info_is_empty_for_a_failure_without_details():
    async with make_channel(_unused_address()) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await sandbox_pb2_grpc.SandboxServiceStub(channel).GetNodeInfo(
                sandbox_pb2.GetNodeInfoRequest(), timeout=2
            )

    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(caught.value) == (None, {})


async def test_unavailable_is_retried_until_attempts_run_out_then_reraised():
    attempts = 0

    @idempotent_retry(max_attempts=3, **FAST)
    async def get_node_info(channel: grpc.aio.Channel) -> sandbox_pb2.GetNodeInfoResponse:
        nonlocal attempts
        attempts += 1
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        return await stub.GetNodeInfo(sandbox_pb2.GetNodeInfoRequest(), timeout=2)

    async with make_channel(_unused_address()) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await get_node_info(channel)

    assert attempts == 3
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_owned_retryable_reason_is_retried_until_it_succeeds(
    stub, servicer: ChassisTestServicer
):
    servicer.capacity_failures = 2

    async for attempt in async_retrying(max_attempts=5, **FAST):
        with attempt:
            await stub.ListSandboxes(sandbox_pb2.ListSandboxesRequest(), timeout=5)

    assert servicer.list_calls == 3


async def test_other_failures_are_not_retried(stub):
    attempts = 0

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for attempt in async_retrying(max_attempts=5, **FAST):
            with attempt:
                attempts += 1
                await stub.GetSandbox(sandbox_pb2.GetSandboxRequest(sandbox_id="x"), timeout=5)

    assert attempts == 1
    assert error_info(caught.value)[0] == "SANDBOX_NOT_FOUND"


async def test_no_backoff_runs_past_the_retry_bound():
    # Waits of 0.2, 0.4, 0.8 s and more (plus jitter) against a bound of 1 s: the wait that
    # would cross the bound is cut to end at it, so the last attempt starts at the bound, never
    # after it (0.25 s is the event loop's lag on a loaded machine).
    attempt_starts: list[float] = []
    started = time.monotonic()
    async with make_channel(_unused_address()) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for attempt in async_retrying(max_attempts=10, max_delay_s=1.0):
                with attempt:
                    attempt_starts.append(time.monotonic() - started)
                    await stub.GetNodeInfo(sandbox_pb2.GetNodeInfoRequest(), timeout=0.2)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert 2 <= len(attempt_starts) < 10
    assert 1.0 <= max(attempt_starts) < 1.0 + 0.25, attempt_starts


def test_non_grpc_exceptions_are_never_retryable():
    assert not is_retryable(ValueError("boom"))
