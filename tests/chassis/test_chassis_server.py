"""GrpcServer: health, reflection, metrics endpoint, TLS, serving status, drain and callbacks."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from google.protobuf import duration_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from testkit.chassis import SANDBOX_SERVICE, TOKEN, ChassisTestServicer

from swerl.chassis.client import make_channel
from swerl.chassis.server import GrpcServer
from swerl.exec.v1 import sandbox_pb2, sandbox_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return response.status


def _slow_renew(stub: sandbox_pb2_grpc.SandboxServiceStub, seconds: int):
    return stub.RenewSandbox(
        sandbox_pb2.RenewSandboxRequest(
            sandbox_id="sbx-slow", ttl=duration_pb2.Duration(seconds=seconds)
        ),
        timeout=30,
    )


async def test_start_binds_a_free_port_when_port_is_zero(server: GrpcServer):
    assert server.bound_port > 0
    assert server.address == f"127.0.0.1:{server.bound_port}"


async def test_every_registered_service_and_the_server_report_serving(server: GrpcServer):
    assert await _health(server.address) == SERVING
    assert await _health(server.address, SANDBOX_SERVICE) == SERVING


async def test_health_of_an_unknown_service_is_not_found(server: GrpcServer):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _health(server.address, "no.such.Service")

    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_set_serving_changes_one_service_or_all(server: GrpcServer):
    await server.set_serving(False, SANDBOX_SERVICE)
    assert await _health(server.address, SANDBOX_SERVICE) == NOT_SERVING
    assert await _health(server.address) == SERVING

    await server.set_serving(False)
    assert await _health(server.address) == NOT_SERVING

    await server.set_serving(True)
    assert await _health(server.address, SANDBOX_SERVICE) == SERVING


async def test_reflection_lists_registered_services_health_and_reflection(server: GrpcServer):
    async with make_channel(server.address, token=TOKEN) as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        responses = [response async for response in call]

    names = {service.name for service in responses[0].list_services_response.service}
    assert names == {
        SANDBOX_SERVICE,
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }


async def test_reflection_serves_the_descriptor_of_a_registered_service(server: GrpcServer):
    async with make_channel(server.address, token=TOKEN) as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=SANDBOX_SERVICE)]),
            timeout=5,
        )
        responses = [response async for response in call]

    files = responses[0].file_descriptor_response.file_descriptor_proto
    assert files, responses[0]


async def test_metrics_endpoint_serves_rpc_counters_after_calls(make_server, servicer):
    server = await make_server(metrics_port=0)
    async with make_channel(server.address, token=TOKEN) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        await stub.GetNodeInfo(sandbox_pb2.GetNodeInfoRequest(), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.GetSandbox(sandbox_pb2.GetSandboxRequest(sandbox_id="x"), timeout=5)

    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())

    assert (
        'swerl_rpc_requests_total{code="OK",method="/swerl.exec.v1.SandboxService/GetNodeInfo"}'
        in body
    )
    assert (
        'swerl_rpc_requests_total{code="NOT_FOUND",'
        'method="/swerl.exec.v1.SandboxService/GetSandbox"}' in body
    )
    assert "swerl_rpc_duration_seconds_bucket" in body
    assert "swerl_rpc_in_flight" in body


async def test_metrics_endpoint_is_off_unless_configured(server: GrpcServer):
    assert server.metrics_port is None


async def test_tls_round_trip_with_a_self_signed_certificate(make_server, tls_files):
    server = await make_server(
        tls_cert_file=tls_files.server_cert, tls_key_file=tls_files.server_key
    )

    async with make_channel(
        server.address, token=TOKEN, tls_ca_file=tls_files.server_cert
    ) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        response = await stub.GetNodeInfo(sandbox_pb2.GetNodeInfoRequest(), timeout=5)

    assert response.node_id


async def test_plaintext_client_cannot_talk_to_a_tls_server(make_server, tls_files):
    server = await make_server(
        tls_cert_file=tls_files.server_cert, tls_key_file=tls_files.server_key
    )

    async with make_channel(server.address, token=TOKEN) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetNodeInfo(sandbox_pb2.GetNodeInfoRequest(), timeout=5)

    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_ca_makes_the_server_require_a_client_certificate(make_server, tls_files):
    server = await make_server(
        tls_cert_file=tls_files.server_cert,
        tls_key_file=tls_files.server_key,
        tls_client_ca_file=tls_files.client_cert,
    )
    request = sandbox_pb2.GetNodeInfoRequest()

    async with make_channel(
        server.address, token=TOKEN, tls_ca_file=tls_files.server_cert
    ) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await sandbox_pb2_grpc.SandboxServiceStub(channel).GetNodeInfo(request, timeout=5)
    async with make_channel(
        server.address,
        token=TOKEN,
        tls_ca_file=tls_files.server_cert,
        tls_client_cert_file=tls_files.client_cert,
        tls_client_key_file=tls_files.client_key,
    ) as channel:
        response = await sandbox_pb2_grpc.SandboxServiceStub(channel).GetNodeInfo(
            request, timeout=5
        )

    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert response.node_id


async def test_stop_drains_in_flight_calls_before_shutdown_callbacks(
    server: GrpcServer, stub, servicer: ChassisTestServicer
):
    finished_before_callback: list[bool] = []

    async def on_shutdown() -> None:
        finished_before_callback.append(servicer.slow_call_finished.is_set())

    server.add_shutdown_callback(on_shutdown)
    slow = asyncio.ensure_future(_slow_renew(stub, 1))
    await asyncio.wait_for(servicer.slow_call_started.wait(), 5)

    await server.stop(grace_s=10)

    assert (await slow).sandbox.sandbox_id == "sbx-slow"
    assert finished_before_callback == [True]


async def test_stop_cancels_calls_still_running_after_the_grace_period(
    server: GrpcServer, stub, servicer: ChassisTestServicer
):
    slow = asyncio.ensure_future(_slow_renew(stub, 30))
    await asyncio.wait_for(servicer.slow_call_started.wait(), 5)

    await server.stop(grace_s=0.2)

    with pytest.raises(grpc.aio.AioRpcError):
        await slow
    assert servicer.slow_call_cancelled.is_set()


async def test_health_watchers_see_not_serving_and_do_not_hold_the_drain_open(
    make_server,
):
    server = await make_server(drain_grace_s=30)
    async with grpc.aio.insecure_channel(server.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=30
        )
        first = await watch.read()

        # Would take the whole 30 s grace if the open watch counted as in-flight work.
        await asyncio.wait_for(server.stop(), 5)

        second = await watch.read()
        end = await watch.read()

    assert (first.status, second.status) == (SERVING, NOT_SERVING)
    assert end is grpc.aio.EOF
    assert await watch.code() == grpc.StatusCode.OK


async def test_stop_is_idempotent_and_concurrent_calls_wait_for_the_same_stop(
    server: GrpcServer,
):
    calls = 0

    async def on_shutdown() -> None:
        nonlocal calls
        calls += 1

    server.add_shutdown_callback(on_shutdown)

    await asyncio.gather(server.stop(), server.stop())
    await server.stop()

    assert calls == 1


async def test_failing_shutdown_callback_does_not_skip_the_others(server: GrpcServer):
    ran: list[str] = []

    async def failing() -> None:
        raise RuntimeError("cleanup failed")

    async def succeeding() -> None:
        ran.append("second")

    server.add_shutdown_callback(failing)
    server.add_shutdown_callback(succeeding)

    await server.stop()

    assert ran == ["second"]


async def test_add_service_after_start_is_refused(server: GrpcServer, servicer):
    with pytest.raises(RuntimeError, match="before start"):
        server.add_service(
            sandbox_pb2_grpc.add_SandboxServiceServicer_to_server, servicer, [SANDBOX_SERVICE]
        )
