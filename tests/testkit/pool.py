"""Exec nodes and a pool as separate processes on loopback, for the acceptance and chaos tests,
and the check every pool test ends with: no sandbox container of its nodes left on dockerd.

Ports are picked up front, so a killed process restarts on the same address (holders and the
pool reconnect to it) with the same state dir (the node re-adopts its sandboxes, the pool re-reads
its node list).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import docker
import grpc

from swerl.pool.v1 import pool_pb2 as pb
from swerl.pool.v1 import pool_pb2_grpc

START_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Proc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name, self.argv, self.env, self.log_path = name, argv, env, log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: no cleanup of any kind runs."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.alive:
            assert self.process is not None
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


class Cluster:
    def __init__(
        self,
        workdir: Path,
        *,
        nodes: int = 3,
        node_capacity: int = 4,
        pool_args: tuple[str, ...] = (),
    ) -> None:
        self.workdir = workdir
        self.token = secrets.token_hex(16)
        self.secret = secrets.token_hex(32)
        self.pool_address = f"127.0.0.1:{free_port()}"
        run = [sys.executable, "-m", "swerl.cli"]
        self.pool = Proc(
            "pool",
            [
                *run,
                "pool",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                self.pool_address.rsplit(":", 1)[1],
                "--state-dir",
                str(workdir / "pool"),
                "--log-level",
                "warning",
                "--drain-grace-s",
                "1",
                *pool_args,
            ],
            {"SWERL_POOL_AUTH_TOKEN": self.token, "SWERL_POOL_CAPABILITY_SECRET": self.secret},
            workdir / "pool.log",
        )
        self.node_ids = [f"chaos-{i}-{secrets.token_hex(3)}" for i in range(nodes)]
        self.nodes: list[Proc] = []
        self.node_addresses: list[str] = []
        for i, node_id in enumerate(self.node_ids):
            address = f"127.0.0.1:{free_port()}"
            self.node_addresses.append(address)
            self.nodes.append(
                Proc(
                    node_id,
                    [
                        *run,
                        "exec",
                        "serve",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        address.rsplit(":", 1)[1],
                        "--node-id",
                        node_id,
                        "--state-dir",
                        str(workdir / f"node-{i}"),
                        "--max-sandboxes",
                        str(node_capacity),
                        "--pool-address",
                        self.pool_address,
                        "--reap-interval-s",
                        "0.5",
                        "--default-memory-bytes",
                        str(512 << 20),
                        "--log-level",
                        "warning",
                        "--drain-grace-s",
                        "1",
                    ],
                    {
                        "SWERL_EXEC_AUTH_TOKEN": self.token,
                        "SWERL_EXEC_CAPABILITY_SECRET": self.secret,
                    },
                    workdir / f"node-{i}.log",
                )
            )

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self.pool.start()
        for node in self.nodes:
            node.start()
        self.wait_healthy(len(self.nodes))

    def stub(self) -> tuple[grpc.Channel, pool_pb2_grpc.PoolServiceStub]:
        channel = grpc.insecure_channel(self.pool_address)
        return channel, pool_pb2_grpc.PoolServiceStub(channel)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    def wait_healthy(self, count: int, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        channel, stub = self.stub()
        try:
            while True:
                with contextlib.suppress(grpc.RpcError):
                    nodes = stub.ListNodes(
                        pb.ListNodesRequest(), timeout=2, metadata=self.metadata
                    ).nodes
                    if sum(n.state == pb.NODE_STATE_HEALTHY for n in nodes) >= count:
                        return
                for proc in (self.pool, *self.nodes):
                    if proc.process is not None and not proc.alive and proc.process.returncode:
                        if proc.process.returncode != -signal.SIGKILL:
                            raise RuntimeError(f"{proc.name} exited:\n{proc.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{count} nodes not HEALTHY in time\npool log:\n{self.pool.log_tail()}"
                    )
                time.sleep(0.1)
        finally:
            channel.close()

    def release_everything(self, timeout_s: float = 30.0) -> None:
        """Releases every lease and spare and waits until the nodes confirmed the destroys."""
        channel, stub = self.stub()
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                leases = stub.ListLeases(
                    pb.ListLeasesRequest(), timeout=5, metadata=self.metadata
                ).leases
                for lease in leases:
                    stub.ReleaseLease(
                        pb.ReleaseLeaseRequest(lease_id=lease.lease_id),
                        timeout=30,
                        metadata=self.metadata,
                    )
                if not leases and not self.containers():
                    return
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"leases {[x.lease_id for x in leases]} / containers"
                        f" {self.containers()} not gone in time"
                    )
                time.sleep(0.2)
        finally:
            channel.close()

    def containers(self) -> list[str]:
        client = docker.from_env()
        try:
            names = []
            for node_id in self.node_ids:
                found = client.containers.list(all=True, filters={"label": f"swerl.node={node_id}"})
                names += [c.name for c in found]
            return names
        finally:
            client.close()

    def close(self) -> list[str]:
        """Stops everything; returns (and then removes) containers that were left behind."""
        for proc in (*self.nodes, self.pool):
            proc.stop()
        left = self.containers()
        client = docker.from_env()
        try:
            for node_id in self.node_ids:
                found = client.containers.list(all=True, filters={"label": f"swerl.node={node_id}"})
                for container in found:
                    with contextlib.suppress(docker.errors.APIError):
                        container.remove(force=True)
        finally:
            client.close()
        return left


def swerl_containers(node_ids: list[str]) -> list[str]:
    client = docker.from_env()
    try:
        names: list[str] = []
        for node_id in node_ids:
            found = client.containers.list(all=True, filters={"label": f"swerl.node={node_id}"})
            names += [c.name for c in found]
        return names
    finally:
        client.close()


async def assert_no_sandboxes_left(node_ids: list[str], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        left = await asyncio.to_thread(swerl_containers, node_ids)
        if not left:
            return
        assert time.monotonic() < deadline, f"sandboxes left behind: {left}"
        await asyncio.sleep(0.2)
