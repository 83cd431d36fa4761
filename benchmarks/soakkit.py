"""The soak's cluster: a dockerd of its own, 3 exec nodes, the pool, 2 agents and the replay
policies, each a separate process on loopback, and the faults injected into them.

The soak restarts dockerd, so it never uses the machine's shared one (other work runs on it): it
starts a private dockerd under its work dir (a bridge of its own, never `--bridge none`, which
would delete the shared dockerd's docker0; no iptables), loads the base image into
it with `docker save | docker load`, builds the task images in it (offline), and points the exec
nodes at it through DOCKER_HOST. Ports are picked up front, so a killed process restarts on the
same address with the same state dir (a node re-adopts its sandboxes, the pool re-reads its
nodes).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import docker
import grpc
import psutil
from benchkit import create_bridge, delete_bridge
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swerl.pool.v1 import pool_pb2, pool_pb2_grpc
from swerl.tasks import TaskInstance

START_TIMEOUT_S = 120.0
# Replay policy variants the soak runs, one server process each ("garbage" answers noise).
# What each replay policy plays: a variant of the bundled tasks' scripts, and how the episode
# acts: the builtin loop's bash blocks (no suffix), its native tool calls (`-tools`: agent config
# `tools`, Qwen's <tool_call> format) or the mini-swe-agent harness over the episode's gateway
# session (`-mini`).
POLICY_VARIANTS = (
    "gold",
    "wrong",
    "garbage",
    "destructive",
    "gold-tools",
    "wrong-tools",
    "gold-mini",
    "wrong-mini",
)
TOOL_CALL_PARSER = "qwen25"
HARNESS = "mini-swe-agent"


def variant_parts(variant: str) -> tuple[str, str]:
    """A policy variant's script (gold, wrong, ...) and how its episodes act ("", "tools",
    "mini")."""
    script, _, kind = variant.partition("-")
    return script, kind


def replay_args(variant: str) -> list[str]:
    """`swerl replay serve` arguments of a policy variant."""
    script, kind = variant_parts(variant)
    args = ["--garbage"] if script == "garbage" else ["--variant", script]
    if kind == "tools":
        args += ["--tool-call-parser", TOOL_CALL_PARSER]
    elif kind == "mini":
        args += ["--harness", HARNESS]
    return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_bytes(pid: int | None) -> int:
    """Resident memory of a process, 0 when it is gone."""
    if pid is None:
        return 0
    with contextlib.suppress(psutil.Error):
        return int(psutil.Process(pid).memory_info().rss)
    return 0


class Proc:
    """One service process: started in its own session (so signals reach only it), logging to a
    file, and restartable with the same command line."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name, self.argv, self.env, self.log_path = name, argv, env, log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL: no cleanup of any kind runs."""
        if self.alive:
            self.signal(signal.SIGKILL)
        assert self.process is not None
        self.process.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> None:
        if not self.alive:
            return
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGCONT)  # A stopped process cannot see SIGTERM.
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def check_running(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited ({self.process.returncode}):\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"


class PrivateDockerd:
    """A dockerd the soak owns (and may restart) under `root`, beside the machine's shared one."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = root / "sock"
        self.host = f"unix://{self.socket}"
        (root / "data").mkdir(parents=True, exist_ok=True)
        config = root / "daemon.json"
        config.write_text("{}\n")  # Never the machine's /etc/docker/daemon.json.
        self.bridge = create_bridge()  # kept across restarts, deleted by destroy()
        argv = [
            "dockerd",
            "--data-root",
            str(root / "data"),
            "--exec-root",
            str(root / "exec"),
            "--pidfile",
            str(root / "pid"),
            "--host",
            self.host,
            "--config-file",
            str(config),
            "--bridge",
            self.bridge,
            "--iptables=false",
        ]
        self.proc = Proc("dockerd", argv, {}, root / "dockerd.log")

    def start(self, timeout_s: float = 60.0) -> None:
        self.proc.start()
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            self.proc.check_running()
            if time.monotonic() > deadline:
                raise RuntimeError(f"private dockerd not up in time:\n{self.proc.log_tail()}")
            time.sleep(0.2)

    def answers(self) -> bool:
        try:
            client = docker.DockerClient(base_url=self.host, timeout=5)
        except docker.errors.DockerException:
            return False
        try:
            client.ping()
            return True
        except (docker.errors.DockerException, OSError):
            return False
        finally:
            client.close()

    def stop(self) -> None:
        # dockerd stops its containers first; a generous bound covers that on a busy machine.
        self.proc.stop(timeout_s=60.0)

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.host, timeout=120)

    def load_images(self, images: list[str]) -> None:
        """Copies images from the shared dockerd: one `docker save` stream (shared layers once)
        into `docker load`."""
        save = subprocess.Popen(["docker", "save", *images], stdout=subprocess.PIPE)
        assert save.stdout is not None
        load = subprocess.run(
            ["docker", "-H", self.host, "load", "-q"],
            stdin=save.stdout,
            capture_output=True,
            timeout=600,
        )
        save.stdout.close()
        if save.wait(timeout=60) != 0 or load.returncode != 0:
            raise RuntimeError(f"loading images into the private dockerd failed: {load.stderr!r}")

    def build_task_images(self, tasks: list[TaskInstance], base_image: str) -> None:
        """Builds the task images here, as `swerl tasks build` would, without a network: the
        bundled tasks' builds need none, and this dockerd has no bridge."""
        for task in tasks:
            build = subprocess.run(
                [
                    "docker",
                    "-H",
                    self.host,
                    "build",
                    "-q",
                    "--network",
                    "none",
                    "--build-arg",
                    f"BASE_IMAGE={base_image}",
                    "--label",
                    f"swerl.task={task.instance_id}",
                    "-t",
                    task.image_name,
                    str(task.directory),
                ],
                capture_output=True,
                timeout=600,
            )
            if build.returncode != 0:
                raise RuntimeError(f"building {task.image_name} failed: {build.stderr!r}")

    def sandboxes(self) -> list[str]:
        """Every container a swerl node made here (all of them are the soak's)."""
        client = self.client()
        try:
            found = client.containers.list(all=True, filters={"label": "swerl.node"})
            return [c.name for c in found]
        finally:
            client.close()

    def destroy(self) -> None:
        """Stops dockerd after removing whatever is left, and deletes its directory."""
        if self.proc.alive:
            with contextlib.suppress(docker.errors.DockerException, OSError):
                client = self.client()
                for container in client.containers.list(all=True):
                    with contextlib.suppress(docker.errors.APIError):
                        container.remove(force=True)
                client.close()
        self.stop()
        # Anything dockerd mounted under its root is gone once it stopped; rm then succeeds.
        subprocess.run(["rm", "-rf", str(self.root)], check=False)
        delete_bridge(self.bridge)


@dataclass
class SoakCluster:
    """The services under test. `start` brings them up; `wait_*` bound every wait."""

    workdir: Path
    dockerd: PrivateDockerd
    nodes: int = 3
    node_capacity: int = 6
    agents: int = 2
    lease_ttl_s: float = 30.0
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    secret: str = field(default_factory=lambda: secrets.token_hex(32))

    def __post_init__(self) -> None:
        run = [sys.executable, "-m", "swerl.cli"]
        self.pool_address = f"127.0.0.1:{free_port()}"
        quiet = ["--log-level", "warning", "--drain-grace-s", "1"]
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
                str(self.workdir / "pool"),
                "--default-ttl-s",
                str(self.lease_ttl_s),
                "--node-expiry-slack-s",
                "5",
                "--maintenance-interval-s",
                "0.5",
                "--expiry-interval-s",
                "0.5",
                "--release-wait-s",
                "5",
                *quiet,
            ],
            {"SWERL_POOL_AUTH_TOKEN": self.token, "SWERL_POOL_CAPABILITY_SECRET": self.secret},
            self.workdir / "pool.log",
        )
        self.node_procs: list[Proc] = []
        self.node_ids = [f"soak-{i}-{secrets.token_hex(3)}" for i in range(self.nodes)]
        for i, node_id in enumerate(self.node_ids):
            port = free_port()
            self.node_procs.append(
                Proc(
                    f"node-{i}",
                    [
                        *run,
                        "exec",
                        "serve",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--node-id",
                        node_id,
                        "--state-dir",
                        str(self.workdir / f"node-{i}"),
                        "--max-sandboxes",
                        str(self.node_capacity),
                        "--pool-address",
                        self.pool_address,
                        "--reap-interval-s",
                        "1",
                        "--default-memory-bytes",
                        str(512 << 20),
                        *quiet,
                    ],
                    {
                        "SWERL_EXEC_AUTH_TOKEN": self.token,
                        "SWERL_EXEC_CAPABILITY_SECRET": self.secret,
                        "DOCKER_HOST": self.dockerd.host,
                    },
                    self.workdir / f"node-{i}.log",
                )
            )
        self.agent_addresses = [f"127.0.0.1:{free_port()}" for _ in range(self.agents)]
        self.agent_procs = [
            Proc(
                f"agent-{i}",
                [
                    *run,
                    "agent",
                    "serve",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    address.rsplit(":", 1)[1],
                    "--pool-address",
                    self.pool_address,
                    "--lease-wait-s",
                    "60",
                    "--tokenizer-processes",
                    "1",
                    *quiet,
                ],
                {"SWERL_AGENT_AUTH_TOKEN": self.token},
                self.workdir / f"agent-{i}.log",
            )
            for i, address in enumerate(self.agent_addresses)
        ]
        self.policy_urls: dict[str, str] = {}
        self.policy_procs: dict[str, Proc] = {}
        for variant in POLICY_VARIANTS:
            # Port 0: the server binds a port of its own and prints its URL, which wait_policy
            # reads (a port probed free here can be taken by another process before the server
            # binds it; a replay policy is never restarted, so its URL holds for the run).
            choice = replay_args(variant)
            self.policy_procs[variant] = Proc(
                f"policy-{variant}",
                [*run, "replay", "serve", "--port", "0", "--fault-control", *choice],
                {},
                self.workdir / f"policy-{variant}.log",
            )

    @property
    def services(self) -> list[Proc]:
        return [self.pool, *self.node_procs, *self.agent_procs, *self.policy_procs.values()]

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        for proc in self.services:
            proc.start()
        self.wait_nodes_healthy()
        for index in range(self.agents):
            self.wait_agent_serving(index)
        for variant in POLICY_VARIANTS:
            self.wait_policy(variant)

    def stop(self) -> None:
        # Agents first (they release their leases), the pool last but one, dockerd after.
        for proc in (*self.agent_procs, *self.policy_procs.values(), *self.node_procs, self.pool):
            proc.stop()

    def wait_nodes_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.pool_address) as channel:
            stub = pool_pb2_grpc.PoolServiceStub(channel)
            while True:
                with contextlib.suppress(grpc.RpcError):
                    nodes = stub.ListNodes(
                        pool_pb2.ListNodesRequest(), timeout=5, metadata=self.metadata
                    ).nodes
                    healthy = sum(n.state == pool_pb2.NODE_STATE_HEALTHY for n in nodes)
                    if healthy >= self.nodes:
                        return
                for proc in (self.pool, *self.node_procs):
                    proc.check_running()
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.nodes} nodes not HEALTHY in {timeout_s:.0f} s\n"
                        f"pool log:\n{self.pool.log_tail()}"
                    )
                time.sleep(0.2)

    def wait_agent_serving(self, index: int, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.agent_addresses[index]) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                with contextlib.suppress(grpc.RpcError):
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                self.agent_procs[index].check_running()
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"agent {index} not SERVING in {timeout_s:.0f} s:\n"
                        f"{self.agent_procs[index].log_tail()}"
                    )
                time.sleep(0.2)

    def wait_policy(self, variant: str, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            url = self.policy_urls.get(variant) or self._served_url(variant)
            if url:
                self.policy_urls[variant] = url
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(url + "/health", timeout=2):
                        return
            self.policy_procs[variant].check_running()
            if time.monotonic() > deadline:
                raise RuntimeError(f"replay policy {variant} not up in {timeout_s:.0f} s")
            time.sleep(0.2)

    def _served_url(self, variant: str) -> str:
        """The URL a replay policy printed once it was serving ("" before that)."""
        log = self.policy_procs[variant].log_path
        text = log.read_text(errors="replace") if log.exists() else ""
        found = re.search(r"serving /generate on (http://\S+)", text)
        return found.group(1) if found else ""

    def policy_fault(self, mode: str, duration_s: float) -> None:
        """Every replay policy answers 500 ("error") or holds requests ("hang") for a window."""
        body = json.dumps({"mode": mode, "duration_s": duration_s}).encode()
        for url in self.policy_urls.values():
            request = urllib.request.Request(
                url + "/fault", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=10) as reply:
                reply.read()

    def open_leases(self) -> list[pool_pb2.Lease]:
        """Leases not ENDED (PENDING, ACTIVE, RELEASING)."""
        with grpc.insecure_channel(self.pool_address) as channel:
            stub = pool_pb2_grpc.PoolServiceStub(channel)
            reply = stub.ListLeases(
                pool_pb2.ListLeasesRequest(), timeout=10, metadata=self.metadata
            )
            return list(reply.leases)

    def memory(self) -> dict[str, int]:
        """RSS of every service and of dockerd, by name."""
        found = {proc.name: rss_bytes(proc.pid) for proc in self.services}
        found["dockerd"] = rss_bytes(self.dockerd.proc.pid)
        return found
