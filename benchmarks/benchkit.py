"""Shared scaffolding of the benchmark scripts (exec_bench.py, eval_bench.py).

Progress lines, the machine facts a report starts with, the node under test as a separate
`swerl exec serve` process (start, wait until SERVING, stop, sweep the containers it left) and
`run_main`, the runner that cleans up on every way out: Ctrl-C or SIGTERM gives 130, an error
1 with its traceback; the cleanup steps run in reverse with SIGINT/SIGTERM ignored, and the
temp workdir is removed. Also the bridge a private dockerd's default network gets (the soak's,
and the tests' second dockerd: tests/testkit/dockerd.py imports it from here). The scripts are run
as `python benchmarks/X.py`, so `benchmarks/` is on sys.path and they import this as `benchkit`
(pytest puts it there for the tests: pyproject's `pythonpath`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

NODE_START_TIMEOUT_S = 90.0


def progress(message: str) -> None:
    print(f"[bench] {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# Machine facts


def software_line(distributions: Sequence[str]) -> str:
    """Python's version and each distribution's installed version, for a report's first lines:
    a figure means little without what it ran on (a dependency's release can move it)."""
    from importlib import metadata

    versions = []
    for name in distributions:
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    return f"python {platform.python_version()} ({sys.prefix}); " + ", ".join(versions)


def load_line() -> str:
    """The machine's load averages and CPU count, sampled now."""
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} / {five:.2f} / {fifteen:.2f} (1/5/15 min) on {os.cpu_count()} CPUs"


def machine_facts(docker_client: docker.DockerClient, hardware: bool = False) -> dict[str, Any]:
    """What a report starts with. `hardware` adds the CPU count and model, the memory and the
    Docker API version."""
    version = docker_client.version()
    info = docker_client.info()
    cpu_model = ""
    if hardware:
        with contextlib.suppress(OSError):
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    facts: dict[str, Any] = {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "docker_server_version": version.get("Version", ""),
        "docker_api_version": version.get("ApiVersion", ""),
        "docker_storage_driver": info.get("Driver", ""),
        # Other work on the machine skews every figure; the load says whether there was any.
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
        "containers_running_at_start": info.get("ContainersRunning", 0),
    }
    if not hardware:
        for key in ("cpu_count", "cpu_model", "memory_gib", "docker_api_version"):
            del facts[key]
    return facts


# ---------------------------------------------------------------------------------------------
# The node under test, a separate process


@dataclass
class Node:
    process: subprocess.Popen[bytes]
    node_id: str
    token: str
    log_path: Path
    # Empty until known: a node started on port 0 prints its port, which wait_serving reads.
    address: str = ""

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_node(
    workdir: Path, node_id_prefix: str, extra_args: Sequence[str] = (), pick_port: bool = False
) -> Node:
    """Starts `swerl exec serve` with a random token and a state dir under `workdir`. With
    `pick_port` it listens on a free port chosen here, else on port 0 (wait_serving then reads
    the port from the node's log). `extra_args` go on its command line (--max-sandboxes N)."""
    port = free_port() if pick_port else 0
    token = secrets.token_urlsafe(24)
    node_id = node_id_prefix + secrets.token_hex(4)
    log_path = workdir / "node.log"
    argv = [
        sys.executable,
        "-m",
        "swerl.cli",
        "exec",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--node-id",
        node_id,
        "--state-dir",
        str(workdir / "state"),
        *extra_args,
        "--log-level",
        "warning",
    ]
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            # The token goes by env var so it does not show up in `ps`.
            env={**os.environ, "SWERL_EXEC_AUTH_TOKEN": token},
            # Its own session: the terminal's Ctrl-C reaches only this script, which then
            # destroys the sandboxes through the node before stopping it.
            start_new_session=True,
        )
    address = f"127.0.0.1:{port}" if port else ""
    where = f" on {address}" if address else ""
    progress(f"started node {node_id} (pid {process.pid}): swerl exec serve{where}, log {log_path}")
    return Node(process, node_id, token, log_path, address)


def wait_serving(node: Node, timeout_s: float = NODE_START_TIMEOUT_S) -> float:
    """Reads the port from the node's "serving on" line where it is not known yet, then polls
    grpc.health.v1 until the node is SERVING; returns the seconds it took."""
    started = time.perf_counter()
    deadline = started + timeout_s
    while not node.address:
        if node.process.poll() is not None:
            raise RuntimeError(f"node exited ({node.process.returncode}):\n{node.log_tail()}")
        with contextlib.suppress(OSError):
            found = re.search(r"serving on (\S+):(\d+)", node.log_path.read_text(errors="replace"))
            if found:
                node.address = f"127.0.0.1:{found.group(2)}"
                break
        if time.perf_counter() > deadline:
            raise RuntimeError(f"node printed no port in {timeout_s:.0f} s:\n{node.log_tail()}")
        time.sleep(0.05)
    with grpc.insecure_channel(node.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            if node.process.poll() is not None:
                raise RuntimeError(f"node exited ({node.process.returncode}):\n{node.log_tail()}")
            with contextlib.suppress(grpc.RpcError):
                reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.perf_counter() - started
            if time.perf_counter() > deadline:
                raise RuntimeError(f"node not SERVING after {timeout_s:.0f} s:\n{node.log_tail()}")
            time.sleep(0.1)


def stop_node(node: Node, timeout_s: float = 30.0) -> None:
    started = time.perf_counter()
    if node.process.poll() is None:
        node.process.send_signal(signal.SIGTERM)
        try:
            node.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            progress(f"node did not stop within {timeout_s:g} s of SIGTERM; killing it")
            node.process.kill()
            node.process.wait(timeout=10)
    progress(
        f"node stopped after {time.perf_counter() - started:.1f} s"
        f" (exit status {node.process.returncode})"
    )


def remove_leftover_containers(docker_client: docker.DockerClient, filters: Mapping) -> int:
    """Backstop: force-removes containers matching `filters` that escaped the normal cleanup
    (a create in flight at Ctrl-C, a node that died)."""
    leftovers = docker_client.containers.list(all=True, filters=dict(filters))
    for container in leftovers:
        with contextlib.suppress(docker.errors.APIError):
            container.remove(force=True)
    return len(leftovers)


def shutdown_node(
    node: Node, docker_client: docker.DockerClient, extra_labels: Sequence[str] = ()
) -> None:
    """Stops the node (its sandboxes destroyed beforehand by the caller), shows what it logged
    past its "serving on" line, and removes any container labelled with its node id or with one
    of `extra_labels` that is still there."""
    stop_node(node)
    # At --log-level warning, anything past the "serving on" line is worth seeing.
    logged = node.log_path.read_text(errors="replace").splitlines()[1:]
    if logged:
        print(f"[bench] node log, warnings and errors ({len(logged)} lines, last 40):")
        print("\n".join("    " + line for line in logged[-40:]), flush=True)
    for label in (f"swerl.node={node.node_id}", *extra_labels):
        removed = remove_leftover_containers(docker_client, {"label": label})
        if removed:
            progress(f"removed {removed} leftover containers ({label})")


# ---------------------------------------------------------------------------------------------
# A private dockerd's bridge


def create_bridge() -> str:
    """A new, empty Linux bridge for a private dockerd's default network (`--bridge NAME`); the
    dockerd gives it an address of its choosing. Delete it with `delete_bridge`."""
    name = "swb" + os.urandom(5).hex()  # interface names hold at most 15 characters
    subprocess.run(["ip", "link", "add", name, "type", "bridge"], check=True)
    subprocess.run(["ip", "link", "set", name, "up"], check=True)
    return name


def delete_bridge(name: str) -> None:
    subprocess.run(["ip", "link", "del", name], check=False, capture_output=True)


# ---------------------------------------------------------------------------------------------
# The runner

Benchmark = Callable[[argparse.Namespace, Path, list[Callable[[], None]]], dict]


def raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_main(args: argparse.Namespace, benchmark: Benchmark, workdir_prefix: str) -> int:
    """Runs `benchmark(args, workdir, cleanup)` in a fresh temp workdir, writes its report to
    args.json when given, and returns the exit status: 0, 130 when interrupted (Ctrl-C or
    SIGTERM), 1 when it failed (traceback printed). `benchmark` appends cleanup steps to
    `cleanup` as it goes; they run in reverse on every way out, with SIGINT and SIGTERM
    ignored meanwhile, and then the workdir is removed."""
    # SIGTERM (a CI timeout, `kill`) cleans up like Ctrl-C does.
    signal.signal(signal.SIGTERM, raise_interrupt)
    workdir = Path(tempfile.mkdtemp(prefix=workdir_prefix))
    cleanup: list[Callable[[], None]] = []
    status = 0
    try:
        report = benchmark(args, workdir, cleanup)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
            progress(f"wrote {args.json}")
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("\n[bench] interrupted", flush=True)
        status = 130
    except Exception:
        print("\n[bench] benchmark failed:", flush=True)
        traceback.print_exc()
        status = 1
    finally:
        # A second Ctrl-C must not leave sandboxes behind half-way through cleaning up.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        progress("cleaning up (Ctrl-C is ignored until done)")
        for step in reversed(cleanup):
            try:
                step()
            except Exception:
                print("[bench] cleanup step failed:", flush=True)
                traceback.print_exc()
                status = status or 1
        shutil.rmtree(workdir, ignore_errors=True)
        signal.signal(signal.SIGINT, previous)
    return status
