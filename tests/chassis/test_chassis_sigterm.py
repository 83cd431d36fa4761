"""SIGTERM on a real server process: NOT_SERVING, in-flight calls finish, exit status 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import grpc
from google.protobuf import duration_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swerl.exec.v1 import sandbox_pb2, sandbox_pb2_grpc

SERVER_SCRIPT = Path(__file__).with_name("sigterm_server.py")
TESTS_DIR = Path(__file__).resolve().parents[1]


def _server_env() -> dict[str, str]:
    """The script imports testkit.chassis: tests/ goes on its path as pytest put it on ours."""
    path = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


async def _line(stream: asyncio.StreamReader) -> str:
    return (await asyncio.wait_for(stream.readline(), 20)).decode().strip()


async def test_sigterm_turns_health_not_serving_drains_the_in_flight_call_and_exits_zero():
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(SERVER_SCRIPT),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_server_env(),
    )
    assert process.stdout is not None and process.stderr is not None
    try:
        announced = await _line(process.stdout)
        assert announced.startswith("port "), announced
        address = f"127.0.0.1:{announced.split()[1]}"
        async with grpc.aio.insecure_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=30
            )
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            slow_call = sandbox_pb2_grpc.SandboxServiceStub(channel).RenewSandbox(
                sandbox_pb2.RenewSandboxRequest(
                    sandbox_id="sbx-drain", ttl=duration_pb2.Duration(seconds=1)
                ),
                timeout=30,
            )
            slow = asyncio.ensure_future(slow_call)
            assert await _line(process.stdout) == "slow-call-started"

            process.send_signal(signal.SIGTERM)

            after_signal = await asyncio.wait_for(watch.read(), 10)
            assert after_signal.status == health_pb2.HealthCheckResponse.NOT_SERVING
            response = await asyncio.wait_for(slow, 10)
            assert response.sandbox.sandbox_id == "sbx-drain"
            assert await slow_call.code() == grpc.StatusCode.OK

        exit_status = await asyncio.wait_for(process.wait(), 20)
        stdout_rest = (await process.stdout.read()).decode()
        stderr = (await process.stderr.read()).decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()

    assert exit_status == 0, stderr
    assert stdout_rest.strip() == "exited"
    events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    rpc_lines = [e for e in events if e["event"] == "rpc" and "RenewSandbox" in e["method"]]
    assert [e["code"] for e in rpc_lines] == ["OK"]
    assert [e["signal"] for e in events if e["event"] == "server.signal"] == ["SIGTERM"]
