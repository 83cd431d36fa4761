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

and prints p50/p99 of each, the face's overhead over ExecCommands (target: within 3 ms at p50)
and docker exec's p50 over the face's (target: at least 10x). It reports; it does not assert.
Every sandbox is released and the face stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import docker
from e2b import Sandbox

from swerl.chassis.capability import LEASE_TOKEN_METADATA_KEY
from swerl.pool.client import PoolClient

FACE_START_TIMEOUT_S = 120.0


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


async def exec_commands_samples(
    pool_address: str, token: str, image: str, iterations: int, warmup: int
) -> list[float]:
    pool = PoolClient(pool_address, token=token)
    try:
        async with pool.lease(image, owner="e2b-bench/baseline", ttl_s=120) as lease:
            metadata = ((LEASE_TOKEN_METADATA_KEY, lease.token),)
            async with lease.sandbox.commands(lease.sandbox_id, metadata=metadata) as stream:
                for _ in range(warmup):
                    await stream.run("echo hi")
                samples = []
                for _ in range(iterations):
                    started = time.perf_counter()
                    await stream.run("echo hi")
                    samples.append((time.perf_counter() - started) * 1000)
                return samples
    finally:
        await pool.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument(
        "--image", default=os.environ.get("SWERL_BASE_IMAGE", "swerl-base:bookworm")
    )
    args = parser.parse_args()
    token = secrets.token_urlsafe(24)
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
            try:
                face_ms = timed(
                    lambda: sandbox.commands.run("echo hi"), args.iterations, args.warmup
                )
                exec_ms = asyncio.run(
                    exec_commands_samples(
                        pool_address, token, args.image, args.iterations, args.warmup
                    )
                )
                client = docker.from_env()
                [container] = client.containers.list(filters={"label": "swerl.user.e2b.template"})
                docker_ms = timed(
                    lambda: container.exec_run(["bash", "-c", "echo hi"]),
                    max(30, args.iterations // 5),
                    5,
                )
            finally:
                sandbox.kill()
        finally:
            face.send_signal(signal.SIGINT)
            try:
                face.wait(60)
            except subprocess.TimeoutExpired:
                face.kill()
    rows = [
        ("E2B SDK via swerl e2b serve", face_ms),
        ("swerl ExecCommands", exec_ms),
        ("docker exec (Docker SDK)", docker_ms),
    ]
    print(f"\n{'path':32} {'n':>5} {'p50 ms':>8} {'p99 ms':>8}")
    for name, samples in rows:
        p50, p99 = percentiles(samples)
        print(f"{name:32} {len(samples):5d} {p50:8.2f} {p99:8.2f}")
    face_p50, exec_p50, docker_p50 = (percentiles(s)[0] for _, s in rows)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
