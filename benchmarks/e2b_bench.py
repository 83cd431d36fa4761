"""E2B face benchmark: `commands.run("echo hi")` through the E2B SDK and `swerl e2b serve`,
against swerl's own ExecCommands and `docker exec`, in one run.

    python benchmarks/e2b_bench.py [--iterations N] [--image IMAGE]

Starts `swerl e2b serve` as a separate process (its embedded pool and exec node on the local
dockerd, free ports, a random token), creates one sandbox through the real E2B SDK (sync) and
takes a second lease of the same image from the face's pool. Then it measures the round trip of
`echo hi`, after a warm-up, three ways:

  (a) the E2B SDK's `sandbox.commands.run("echo hi")` through the face (REST + Connect over
      HTTP/1.1 to the face, one Exec call on the node per command),
  (b) swerl's ExecCommands through `swerl.exec.client`'s CommandStream on the second lease (the
      way swerl's own clients run commands),
  (c) `docker exec` through the Docker SDK (`container.exec_run`) on the E2B sandbox's container,
  (d) the face's own launch command for `echo hi` (swerl.e2b.scripts, as the face sends it) over
      the same CommandStream as (b): the sandbox's share of (a), without HTTP, the SDK or the
      face's Python; (a) - (d) is what those add, (d) - (b) what the detached launch adds,

and prints p50/p99 of each, the face's overhead over ExecCommands (target: within 3 ms at p50)
and docker exec's p50 over the face's (target: at least 10x). It reports; it does not assert.
Every sandbox is released and the face stopped on the way out.

The three are measured in interleaved rounds (a batch of each per round), so a shared
machine's load, which drifts over a run, weighs on all three alike; the load average is printed
at the start and the end. Beside the latencies it prints what each path costs in CPU per
command, which queueing does not inflate: the sandbox's (its container's cgroup, through the
Docker API) and, for the face, the face process's (which hosts the embedded pool and node, so
the node's side of the face's calls is in it too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import psutil
from e2b import Sandbox

from swerl.chassis.capability import LEASE_TOKEN_METADATA_KEY
from swerl.e2b.scripts import cleanup_command, job_spec, launch_command
from swerl.exec.client import SandboxClient
from swerl.pool.client import PoolClient

FACE_START_TIMEOUT_S = 120.0
# Commands of each path per interleaved round.
ROUND = 20
# What the face launches for the SDK's `commands.run("echo hi")`, and its report's read cap.
LAUNCH_JOB = job_spec("/bin/bash", ["-l", "-c", "echo hi"], None)
LAUNCH_CAP = 1 << 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def timed(run: Callable[[], object], iterations: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(iterations):
        started = time.perf_counter()
        run()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def start_face(workdir: Path, token: str) -> tuple[subprocess.Popen, int, int, Path]:
    api_port, envd_port = free_port(), free_port()
    log_path = workdir / "face.log"
    argv = [
        sys.executable,
        "-m",
        "swerl.cli",
        "e2b",
        "serve",
        "--host",
        "127.0.0.1",
        "--api-port",
        str(api_port),
        "--envd-port",
        str(envd_port),
        "--log-level",
        "warning",
    ]
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "SWERL_E2B_AUTH_TOKEN": token},
            start_new_session=True,
        )
    return process, api_port, envd_port, log_path


def wait_for_face(log_path: Path, process: subprocess.Popen) -> str:
    """The pool address the face prints once both its ports serve."""
    deadline = time.monotonic() + FACE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"swerl e2b serve exited: {log_path.read_text()[-2000:]}")
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith("swerl e2b:") and " pool " in line:
                return line.rsplit(" pool ", 1)[1].strip()
        time.sleep(0.2)
    raise TimeoutError("swerl e2b serve did not come up")


class ExecCommandsBaseline:
    """A lease of the image from the face's pool and one CommandStream on it, on an event loop
    of its own in a thread; each run is timed inside that loop (no thread hop in the figure)."""

    def __init__(self, pool_address: str, token: str, image: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stack = contextlib.AsyncExitStack()
        self.launches = 0
        self.lease = self._call(self._open(pool_address, token, image))

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(300)

    async def _open(self, pool_address: str, token: str, image: str) -> Any:
        # Made on the thread's loop: a gRPC channel belongs to the loop it was made on.
        self.pool = PoolClient(pool_address, token=token)
        lease = await self.stack.enter_async_context(
            self.pool.lease(image, owner="e2b-bench/baseline", ttl_s=120)
        )
        metadata = ((LEASE_TOKEN_METADATA_KEY, lease.token),)
        self.stream = await self.stack.enter_async_context(
            SandboxClient.for_lease(lease).commands(lease.sandbox_id, metadata=metadata)
        )
        return lease

    async def _timed(self, count: int, launch: bool) -> list[float]:
        samples, records = [], []
        for _ in range(count):
            command = "echo hi"
            if launch:
                self.launches += 1
                records.append(f"bench-{self.launches}")
                command = launch_command(LAUNCH_JOB, records[-1], False, LAUNCH_CAP)
            started = time.perf_counter()
            await self.stream.run(command)
            samples.append((time.perf_counter() - started) * 1000)
        if records:  # the face removes a batch of ended processes' files off the path too
            await self.stream.run(cleanup_command(records))
        return samples

    def samples(self, count: int, *, launch: bool = False) -> list[float]:
        """`count` round trips of `echo hi`, or of the face's launch command for it."""
        return self._call(self._timed(count, launch))

    def close(self) -> None:
        async def closing() -> None:
            await self.stack.aclose()
            await self.pool.close()

        self._call(closing())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def container_cpu_ns(container: Any) -> int:
    """CPU the container's processes have used so far (its cgroup), through the Docker API."""
    stats = container.stats(stream=False, one_shot=True)
    return int(stats["cpu_stats"]["cpu_usage"]["total_usage"])


def lease_container(client: Any, lease_id: str) -> Any:
    [container] = client.containers.list(filters={"label": f"swerl.lease_id={lease_id}"})
    return container


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument(
        "--image", default=os.environ.get("SWERL_BASE_IMAGE", "swerl-base:bookworm")
    )
    args = parser.parse_args()
    token = secrets.token_urlsafe(24)
    started_load = load()
    with tempfile.TemporaryDirectory(prefix="swerl-e2b-bench-") as tmp:
        face, api_port, envd_port, log_path = start_face(Path(tmp), token)
        try:
            pool_address = wait_for_face(log_path, face)
            opts = {
                "api_key": token,
                "api_url": f"http://127.0.0.1:{api_port}",
                "sandbox_url": f"http://127.0.0.1:{envd_port}",
            }
            print(f"face up (pool {pool_address}); creating a sandbox of {args.image}", flush=True)
            sandbox = Sandbox.create(args.image, timeout=600, **opts)
            baseline = ExecCommandsBaseline(pool_address, token, args.image)
            try:
                client = docker.from_env()
                container = lease_container(client, sandbox.sandbox_id)
                baseline_container = lease_container(client, baseline.lease.lease_id)
                face_cpu = psutil.Process(face.pid)
                face_run = lambda: sandbox.commands.run("echo hi")  # noqa: E731
                docker_run = lambda: container.exec_run(["bash", "-c", "echo hi"])  # noqa: E731
                timed(face_run, 0, args.warmup)
                baseline.samples(args.warmup)
                baseline.samples(args.warmup, launch=True)
                timed(docker_run, 0, 3)
                face_ms, exec_ms, docker_ms, launch_ms = [], [], [], []
                rounds = max(1, args.iterations // ROUND)
                cpu = {"box_face": 0, "box_exec": 0, "face_proc": 0.0}
                for _ in range(rounds):
                    box0, proc0 = container_cpu_ns(container), sum(face_cpu.cpu_times()[:2])
                    face_ms += timed(face_run, ROUND, 0)
                    cpu["face_proc"] += sum(face_cpu.cpu_times()[:2]) - proc0
                    cpu["box_face"] += container_cpu_ns(container) - box0
                    box0 = container_cpu_ns(baseline_container)
                    exec_ms += baseline.samples(ROUND)
                    cpu["box_exec"] += container_cpu_ns(baseline_container) - box0
                    docker_ms += timed(docker_run, max(1, ROUND // 5), 0)
                    launch_ms += baseline.samples(ROUND, launch=True)
            finally:
                baseline.close()
                sandbox.kill()
        finally:
            face.send_signal(signal.SIGINT)
            try:
                face.wait(60)
            except subprocess.TimeoutExpired:
                face.kill()
    print(f"load average at the start {started_load}, at the end {load()}")
    rows = [
        ("E2B SDK via swerl e2b serve", face_ms),
        ("swerl ExecCommands", exec_ms),
        ("docker exec (Docker SDK)", docker_ms),
        ("face's launch via ExecCommands", launch_ms),
    ]
    print(f"\n{'path':32} {'n':>5} {'p50 ms':>8} {'p99 ms':>8}")
    for name, samples in rows:
        p50, p99 = percentiles(samples)
        print(f"{name:32} {len(samples):5d} {p50:8.2f} {p99:8.2f}")
    face_p50, exec_p50, docker_p50, launch_p50 = (percentiles(s)[0] for _, s in rows)
    overhead = face_p50 - exec_p50
    ratio = docker_p50 / face_p50
    print(
        f"\nface overhead over ExecCommands at p50: {overhead:.2f} ms (target <= 3 ms):"
        f" {'PASS' if overhead <= 3.0 else 'MISS'}"
    )
    print(
        f"docker exec p50 / face p50: {ratio:.1f}x (target >= 10x):"
        f" {'PASS' if ratio >= 10.0 else 'MISS'}"
    )
    print(
        f"of the overhead at p50: {launch_p50 - exec_p50:.2f} ms the detached launch in the"
        f" sandbox, {face_p50 - launch_p50:.2f} ms HTTP, the SDK and the face's own Python"
    )
    per = len(face_ms)
    print(
        f"CPU per command: sandbox {cpu['box_face'] / 1e6 / per:.2f} ms via the face,"
        f" {cpu['box_exec'] / 1e6 / len(exec_ms):.2f} ms via ExecCommands;"
        f" face process (embedded pool and node included) {cpu['face_proc'] * 1e3 / per:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
