"""The boundary interceptor: error mapping, request ids, the canonical log line, cancellation."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import duration_pb2
from structlog.testing import capture_logs
from testkit.chassis import LEAKED_SECRET, TOKEN, ChassisTestServicer
from testkit.playback import eventually

from swerl.chassis.client import error_info, make_channel, trailing_request_id
from swerl.chassis.errors import ERROR_DOMAIN
from swerl.chassis.server import GrpcServer
from swerl.exec.v1 import sandbox_pb2, sandbox_pb2_grpc

GET_SANDBOX = "/swerl.exec.v1.SandboxService/GetSandbox"


def _rpc_lines(logs: list[dict], method: str) -> list[dict]:
    return [entry for entry in logs if entry["event"] == "rpc" and entry["method"] == method]


async def test_domain_error_becomes_its_code_with_error_info_reason_and_metadata(stub):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetSandbox(sandbox_pb2.GetSandboxRequest(sandbox_id="sbx-1"), timeout=5)

    err = caught.value
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert err.details() == "sandbox sbx-1 does not exist"
    assert error_info(err) == ("SANDBOX_NOT_FOUND", {"sandbox_id": "sbx-1"})


async def test_error_info_carries_the_swerl_domain(stub):
    from google.rpc import error_details_pb2, status_pb2

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetSandbox(sandbox_pb2.GetSandboxRequest(sandbox_id="sbx-1"), timeout=5)

    (details,) = [
        value for key, value in caught.value.trailing_metadata() if key == "grpc-status-details-bin"
    ]
    info = error_details_pb2.ErrorInfo()
    status_pb2.Status.FromString(details).details[0].Unpack(info)
    assert info.domain == ERROR_DOMAIN


async def test_unknown_exception_is_internal_and_leaks_nothing(stub):
    call = stub.GetDiff(sandbox_pb2.GetDiffRequest(sandbox_id="sbx-1"), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call

    err = caught.value
    request_id = trailing_request_id(err.trailing_metadata())
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == f"internal error (request id {request_id})"
    assert LEAKED_SECRET not in repr(err)
    assert error_info(err) == (None, {})


async def test_unknown_exception_is_logged_with_its_traceback(stub):
    method = "/swerl.exec.v1.SandboxService/GetDiff"
    with capture_logs() as logs:
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.GetDiff(sandbox_pb2.GetDiffRequest(sandbox_id="sbx-1"), timeout=5)
        # The server writes its line once the call has ended, which the client may hear first
        # (seen in CI under load): the line is waited for.
        await eventually(lambda: bool(_rpc_lines(logs, method)))

    (line,) = _rpc_lines(logs, method)
    assert line["code"] == "INTERNAL"
    assert line["log_level"] == "error"
    assert isinstance(line["exc_info"], RuntimeError)


async def test_unimplemented_method_is_unimplemented_not_internal(stub):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.CreateSandbox(sandbox_pb2.CreateSandboxRequest(image="x"), timeout=5)

    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_callers_request_id_is_bound_for_the_handler_and_echoed_in_trailers(server):
    async with make_channel(
        server.address, token=TOKEN, request_id_provider=lambda: "req-42"
    ) as ch:
        call = sandbox_pb2_grpc.SandboxServiceStub(ch).GetNodeInfo(
            sandbox_pb2.GetNodeInfoRequest(), timeout=5
        )
        response = await call
        trailing = await call.trailing_metadata()

    assert response.node_id == "req-42"
    assert trailing_request_id(trailing) == "req-42"


async def test_request_id_is_generated_when_the_caller_sends_none(server):
    # A plain channel: no chassis interceptor adding an id.
    async with grpc.aio.insecure_channel(server.address) as ch:
        call = sandbox_pb2_grpc.SandboxServiceStub(ch).GetNodeInfo(
            sandbox_pb2.GetNodeInfoRequest(),
            metadata=(("authorization", f"Bearer {TOKEN}"),),
            timeout=5,
        )
        response = await call
        generated = trailing_request_id(await call.trailing_metadata())

    assert generated
    assert response.node_id == generated


async def test_unprintable_request_id_is_replaced(server):
    async with make_channel(
        server.address, token=TOKEN, request_id_provider=lambda: "x" * 500
    ) as ch:
        call = sandbox_pb2_grpc.SandboxServiceStub(ch).GetNodeInfo(
            sandbox_pb2.GetNodeInfoRequest(), timeout=5
        )
        response = await call

    assert response.node_id and response.node_id != "x" * 500


async def test_request_id_is_echoed_on_errors_too(stub):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetSandbox(
            sandbox_pb2.GetSandboxRequest(sandbox_id="sbx-1"),
            metadata=(("x-request-id", "req-err"),),
            timeout=5,
        )

    assert trailing_request_id(caught.value.trailing_metadata()) == "req-err"


async def test_each_rpc_writes_exactly_one_canonical_log_line(stub):
    with capture_logs() as logs:
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.GetSandbox(
                sandbox_pb2.GetSandboxRequest(sandbox_id="sbx-1"),
                metadata=(("x-request-id", "req-log"),),
                timeout=5,
            )
        await stub.GetNodeInfo(sandbox_pb2.GetNodeInfoRequest(), timeout=5)

    (failed,) = _rpc_lines(logs, GET_SANDBOX)
    assert failed["code"] == "NOT_FOUND"
    assert failed["reason"] == "SANDBOX_NOT_FOUND"
    assert failed["request_id"] == "req-log"
    assert failed["duration_ms"] >= 0
    assert failed["peer"].startswith("ipv4:127.0.0.1:")
    (ok,) = _rpc_lines(logs, "/swerl.exec.v1.SandboxService/GetNodeInfo")
    assert ok["code"] == "OK"
    assert "reason" not in ok


async def test_domain_error_in_the_middle_of_a_server_stream_keeps_code_and_reason(stub):
    call = stub.EnsureImages(
        sandbox_pb2.EnsureImagesRequest(images=["a", "b", "missing", "c"]), timeout=5
    )
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for response in call:
            received.append(response.progress.image)

    assert received == ["a", "b"]
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(caught.value) == ("IMAGE_NOT_PRESENT", {"image": "missing"})


async def test_unknown_exception_in_the_middle_of_a_server_stream_is_internal(stub):
    call = stub.EnsureImages(sandbox_pb2.EnsureImagesRequest(images=["a", "crash"]), timeout=5)
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for response in call:
            received.append(response.progress.image)

    assert received == ["a"]
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert LEAKED_SECRET not in caught.value.details()


async def test_domain_error_in_the_middle_of_a_bidi_stream_keeps_code_and_reason(stub):
    call = stub.Exec(timeout=5)
    await call.write(sandbox_pb2.ExecRequest(stdin=sandbox_pb2.ExecStdin(data=b"hello")))
    first = await call.read()
    await call.write(sandbox_pb2.ExecRequest(stdin=sandbox_pb2.ExecStdin(data=b"fail")))

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()

    assert first.output.data == b"hello"
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(caught.value) == ("INVALID_ARGUMENT", {"field": "stdin"})


async def test_bidi_stream_completes_ok_through_the_boundary(stub):
    call = stub.Exec(timeout=5)
    for chunk in (b"one", b"two"):
        await call.write(sandbox_pb2.ExecRequest(stdin=sandbox_pb2.ExecStdin(data=chunk)))
    await call.done_writing()

    echoed = [response.output.data async for response in call]

    assert echoed == [b"one", b"two"]
    assert await call.code() == grpc.StatusCode.OK


async def test_client_cancellation_reaches_the_handler_and_is_logged_as_cancelled(
    stub, servicer: ChassisTestServicer
):
    with capture_logs() as logs:
        call = stub.RenewSandbox(
            sandbox_pb2.RenewSandboxRequest(
                sandbox_id="sbx-1", ttl=duration_pb2.Duration(seconds=30)
            ),
            timeout=10,
        )
        await asyncio.wait_for(servicer.slow_call_started.wait(), 5)
        call.cancel()
        await asyncio.wait_for(servicer.slow_call_cancelled.wait(), 5)
        # The log line is written as the handler unwinds; give that a moment to finish.
        await eventually(
            lambda: bool(_rpc_lines(logs, "/swerl.exec.v1.SandboxService/RenewSandbox"))
        )

    (line,) = _rpc_lines(logs, "/swerl.exec.v1.SandboxService/RenewSandbox")
    assert line["code"] == "CANCELLED"


async def test_deadline_exceeded_reaches_the_client_as_deadline_exceeded(stub, server: GrpcServer):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.RenewSandbox(
            sandbox_pb2.RenewSandboxRequest(ttl=duration_pb2.Duration(seconds=30)), timeout=0.2
        )

    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
