"""`swerl demo`: a local tour of what is built so far, on the embedded defaults.

Starts an exec node in-process on the local dockerd (insecure, loopback only), creates a sandbox
from the base image, and walks through the exec node's contract: a command, isolation between
commands, a session, a timeout that kills inside the container, bounded output, a diff of the
working tree, and cleanup. Later parts of swerl (pool, agent, evaluation) extend this tour.
"""

from __future__ import annotations

import asyncio
import os
import time

from swerl.exec.client import SandboxClient
from swerl.exec.server import local_node
from swerl.exec.v1 import sandbox_pb2 as pb

DEFAULT_IMAGE = os.environ.get("SWERL_BASE_IMAGE", "swerl-base:bookworm")


def _say(step: str, detail: str = "") -> None:
    print(f"\n== {step}" + (f"\n{detail}" if detail else ""), flush=True)


async def run_demo(image: str = DEFAULT_IMAGE) -> int:
    async with local_node("demo") as (node, channel):
        port = node.port
        client = SandboxClient(channel)
        sandbox_id = ""
        try:
            _say("exec node", f"serving swerl.exec.v1.SandboxService on 127.0.0.1:{port}")
            started = time.monotonic()
            created = await client.stub.CreateSandbox(
                pb.CreateSandboxRequest(request_id="demo-1", image=image, workdir="/work"),
                timeout=60,
            )
            sandbox_id = created.sandbox.sandbox_id
            _say(
                "CreateSandbox",
                f"{sandbox_id} from {image} in {time.monotonic() - started:.2f} s"
                " (network none, pids/memory/cpu limits, labelled, expires on its own)",
            )
            result = await client.run(sandbox_id, "uname -sr; id -un; pwd")
            _say("Exec", result.stdout.decode().rstrip())

            await client.run(sandbox_id, "cd /tmp && export ANSWER=42")
            result = await client.run(sandbox_id, 'echo "cwd=$PWD ANSWER=${ANSWER:-unset}"')
            _say("ISOLATED mode: each command starts fresh", result.stdout.decode().rstrip())

            await client.run(sandbox_id, "cd /tmp && export ANSWER=42", session=True)
            result = await client.run(sandbox_id, 'echo "cwd=$PWD ANSWER=$ANSWER"', session=True)
            _say("SESSION mode: state persists", result.stdout.decode().rstrip())

            started = time.monotonic()
            result = await client.run(sandbox_id, "sleep 1000", timeout_s=1)
            elapsed = time.monotonic() - started
            survivors = await client.run(sandbox_id, "ps -eo cmd | grep -c '^sleep 1000' || true")
            _say(
                "timeout",
                f"timed_out={result.timed_out} exit={result.exit_code} after {elapsed:.2f} s;"
                f" survivors: {survivors.stdout.decode().strip()}",
            )

            result = await client.run(
                sandbox_id, "head -c 50000000 /dev/zero", max_output_bytes=4096
            )
            _say(
                "bounded output",
                f"kept {len(result.stdout)} bytes, dropped {result.bytes_dropped},"
                f" truncated={result.output_truncated}",
            )

            await client.run(
                sandbox_id,
                "git init -q . && git -c user.email=d@x -c user.name=demo commit -q --allow-empty"
                " -m base && echo 'print(1)' > new.py && printf 'x\\0y' > blob.bin",
            )
            diff = await client.stub.GetDiff(
                pb.GetDiffRequest(sandbox_id=sandbox_id, include_untracked=True), timeout=60
            )
            _say(
                "GetDiff",
                f"{len(diff.patch)} bytes against {diff.base_commit[:12]},"
                f" files: {list(diff.files)}",
            )

            latencies = []
            for _ in range(200):
                t = time.perf_counter()
                await client.run(sandbox_id, "echo hi")
                latencies.append(time.perf_counter() - t)
            latencies.sort()
            _say(
                "Exec round trip (echo hi, 200 runs)",
                f"p50 {latencies[100] * 1e3:.2f} ms, p99 {latencies[197] * 1e3:.2f} ms"
                " (benchmarks/exec_bench.py compares with docker exec)",
            )
        finally:
            if sandbox_id:
                response = await client.stub.DestroySandbox(
                    pb.DestroySandboxRequest(sandbox_id=sandbox_id), timeout=60
                )
                _say("DestroySandbox", f"existed={response.existed}; nothing left behind")
    return 0


def main() -> int:
    return asyncio.run(run_demo())
