"""exec_bench's `--runtime` comparison (issue 38): the exec node on each runtime and isolation
class in one run, with `docker exec` on dockerd (runc) as the baseline measured in the same run.

Per target: create+start of a sandbox (CreateSandbox, one at a time), the ExecCommands round trip
of `echo hi` (p50/p99), the runtime's own exec of the same command through its Docker-compatible
API (`docker exec` / `podman exec`), and ExecCommands throughput with 16 sessions. Targets:
docker (dockerd, runc), podman (its compatible service), gvisor (dockerd with runsc),
podman-gvisor (Podman's runsc service); deploy/podman-up.sh and deploy/gvisor-up.sh set them up.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
from benchkit import load_line, progress, shutdown_node, start_node, wait_serving

# name -> (--runtime, --isolation, API socket; None: DOCKER_HOST's dockerd)
TARGETS: dict[str, tuple[str, str, str | None]] = {
    "docker": ("docker", "runc", None),
    "podman": ("podman", "runc", "unix:///run/podman/podman.sock"),
    "gvisor": ("docker", "gvisor", None),
    "podman-gvisor": ("podman", "gvisor", "unix:///run/podman/podman-runsc.sock"),
}
THROUGHPUT_SESSIONS = 16
CREATES = 5


def parse_targets(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TARGETS]
    if unknown:
        raise ValueError(f"unknown runtime target(s) {unknown}: one of {', '.join(TARGETS)}")
    return names


def compare(
    args: Any,
    workdir: Path,
    cleanup: list[Callable[[], None]],
    bench: Any,  # the exec_bench module: its measuring functions
) -> dict[str, Any]:
    targets = parse_targets(args.runtime)
    if "docker" not in targets:
        targets.insert(0, "docker")  # the baseline is measured in the same run
    print(f"  {load_line()} at the start", flush=True)
    rows: dict[str, dict[str, float]] = {}
    for name in targets:
        runtime, isolation, socket = TARGETS[name]
        progress(f"{name}: --runtime {runtime} --isolation {isolation} ({socket or 'DOCKER_HOST'})")
        rows[name] = _one(args, workdir / name, cleanup, bench, runtime, isolation, socket)
    base_exec = rows["docker"]["runtime_exec_p50_ms"]
    print(
        f"\n  {'target':<14} {'create+start p50':>17} {'ExecCommands p50':>17} {'p99':>9}"
        f" {'runtime exec p50':>17} {'x docker exec':>14} {'cmds/s @16':>11}"
    )
    for name, row in rows.items():
        print(
            f"  {name:<14} {row['create_p50_ms']:>14.1f} ms {row['stream_p50_ms']:>14.3f} ms"
            f" {row['stream_p99_ms']:>6.2f} ms {row['runtime_exec_p50_ms']:>14.1f} ms"
            f" {base_exec / row['stream_p50_ms']:>13.1f}x {row['cmds_per_s_16']:>11.1f}"
        )
    print(
        "  (x docker exec: dockerd's own exec p50 over this target's ExecCommands p50, both"
        " measured in this run)"
    )
    print(f"  {load_line()} at the end", flush=True)
    return {"runtimes": rows}


def _one(
    args: Any,
    workdir: Path,
    cleanup: list[Callable[[], None]],
    bench: Any,
    runtime: str,
    isolation: str,
    socket: str | None,
) -> dict[str, float]:
    workdir.mkdir(parents=True, exist_ok=True)
    flags = ["--max-sandboxes", str(THROUGHPUT_SESSIONS + CREATES + 1), "--runtime", runtime]
    flags += ["--isolation", isolation]
    if socket:
        flags += ["--docker-host", socket]
    client = docker.DockerClient(base_url=socket) if socket else docker.from_env()
    node = start_node(workdir, f"bench-{runtime}-{isolation}-", flags, pick_port=True)
    created: list[str] = []

    def stop() -> None:
        if node.process.poll() is None and created:
            asyncio.run(bench.destroy_sandboxes(node, list(created)))
        shutdown_node(node, client)
        client.close()

    cleanup.append(stop)
    wait_serving(node)
    creates = []
    for _ in range(CREATES):
        started = time.perf_counter()
        asyncio.run(bench.create_sandboxes(node, args.image, 1, created, "create"))
        creates.append((time.perf_counter() - started) * 1e3)
    sandbox = created[0]
    stream = bench.percentiles_ms(
        asyncio.run(bench.measure_grpc_stream(node, sandbox, args.warmup, args.iterations))
    )
    own = bench.percentiles_ms(
        bench.measure_docker_exec(client, sandbox, min(args.warmup, 5), args.docker_iterations)
    )
    more = THROUGHPUT_SESSIONS - len(created)
    asyncio.run(bench.create_sandboxes(node, args.image, more, created, "session"))
    run = bench.throughput_in_process(node, created[:THROUGHPUT_SESSIONS], args.duration, True, ())
    stop()
    cleanup.remove(stop)
    row = {
        "create_p50_ms": statistics.median(creates),
        "create_max_ms": max(creates),
        "stream_p50_ms": stream["p50_ms"],
        "stream_p99_ms": stream["p99_ms"],
        "runtime_exec_p50_ms": own["p50_ms"],
        "cmds_per_s_16": run.commands_per_s,
        "errors_16": float(len(run.errors)),
    }
    print(
        f"  {runtime}/{isolation}: create+start p50 {row['create_p50_ms']:.1f} ms (n={CREATES}),"
        f" ExecCommands p50 {row['stream_p50_ms']:.3f} ms p99 {row['stream_p99_ms']:.3f} ms,"
        f" its own exec p50 {row['runtime_exec_p50_ms']:.1f} ms,"
        f" {row['cmds_per_s_16']:.1f} cmds/s at {THROUGHPUT_SESSIONS} sessions"
        f" ({len(run.errors)} errors)",
        flush=True,
    )
    return row
