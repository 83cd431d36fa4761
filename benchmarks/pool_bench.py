"""Pool benchmark: AcquireLease latency (warm and cold) against plain container create+start, and
a control-plane scale run with 1,000 simulated nodes.

    python benchmarks/pool_bench.py [--samples N] [--nodes 1000] [--leases 20000]
                                    [--steady-s S] [--json OUT]

Part 1 (real dockerd): starts `swerl exec serve` and `swerl pool serve` as separate processes
(the node registers itself with the pool), then measures, in one run:
  (a) the baseline: Docker SDK `containers.create` + `start` of the base image,
  (b) cold AcquireLease (the pool creates a sandbox on the node) p50/p99, and its overhead over
      the baseline p50 (target: cold <= docker create+start + 30 ms),
  (c) warm AcquireLease (a prewarmed spare is bound to the lease) p50/p99 (target <= 10 ms).
Part 2 (control plane): a pool process whose nodes are 1,000 in-process simulated nodes behind
the pool's NodeConnection Protocol (sandboxes are dict entries, so only the pool's work counts);
this process acquires 20,000 leases over gRPC and renews every one of them once a second over
multiplexed KeepAlive streams, then holds that load for a steady window while probe leases are
acquired and released. It prints acquire p50/p99 (target p99 <= 25 ms), the achieved renewal
rate, the pool process's CPU, and its CPU per acquire (over the ramp, and net of the renewals
acknowledged during the ramp, costed at the steady state's CPU per renewal).

It reports; it does not assert. Every sandbox is released and every process stopped on the way
out, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import grpc
import psutil
from benchkit import (
    free_port,
    machine_facts,
    progress,
    remove_leftover_containers,
    run_main,
    shutdown_node,
    start_node,
    wait_serving,
)

from swerl.chassis.timeconv import duration_pb
from swerl.pool.v1 import pool_pb2 as pb
from swerl.pool.v1 import pool_pb2_grpc

DEFAULT_IMAGE = os.environ.get("SWERL_BASE_IMAGE", "swerl-base:bookworm")
TARGET_WARM_P50_MS = 10.0
TARGET_COLD_OVERHEAD_MS = 30.0
TARGET_SCALE_P99_MS = 25.0
SIM_IMAGE = "swerl-sim/task:1"
SIM_NODE_CAPACITY = 32


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def figures(name: str, durations_s: list[float]) -> dict[str, float]:
    ms = [d * 1000 for d in durations_s]
    out = {
        "n": len(ms),
        "p50_ms": statistics.median(ms) if ms else float("nan"),
        "p99_ms": percentile(ms, 0.99),
        "mean_ms": statistics.fmean(ms) if ms else float("nan"),
    }
    print(
        f"  {name:<34} n={out['n']:<6} p50 {out['p50_ms']:8.2f} ms   p99 {out['p99_ms']:8.2f} ms",
        flush=True,
    )
    return out


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


# ---------------------------------------------------------------------------------------------
# Part 1: real dockerd


def measure_docker_baseline(
    client: docker.DockerClient, image: str, samples: int, label: str
) -> list[float]:
    durations = []
    for _ in range(samples + 1):
        started = time.perf_counter()
        container = client.containers.create(
            image, command=["sleep", "infinity"], labels={label: "1"}, network_mode="none"
        )
        container.start()
        durations.append(time.perf_counter() - started)
        container.remove(force=True)
    return durations[1:]  # The first run warms Docker's caches.


def start_pool(workdir: Path, token: str, secret: str, port: int, extra: list[str]) -> Any:
    log_path = workdir / "pool.log"
    argv = [
        sys.executable,
        "-m",
        "swerl.cli",
        "pool",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--state-dir",
        str(workdir / "pool-state"),
        "--log-level",
        "warning",
        *extra,
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                "SWERL_POOL_AUTH_TOKEN": token,
                "SWERL_POOL_CAPABILITY_SECRET": secret,
            },
            start_new_session=True,
        )
    progress(f"started pool (pid {process.pid}) on 127.0.0.1:{port}, log {log_path}")
    return process


def stop_process(process: Any) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


async def wait_nodes(stub, metadata, count: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(grpc.aio.AioRpcError):
            nodes = (
                await stub.ListNodes(pb.ListNodesRequest(), timeout=10, metadata=metadata)
            ).nodes
            if sum(n.state == pb.NODE_STATE_HEALTHY for n in nodes) >= count:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} nodes not HEALTHY after {timeout_s:g} s")
        await asyncio.sleep(0.1)


async def measure_acquires(address: str, token: str, image: str, samples: int) -> dict:
    metadata = (("authorization", f"Bearer {token}"),)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pool_pb2_grpc.PoolServiceStub(channel)
        await wait_nodes(stub, metadata, 1)

        async def acquire() -> tuple[float, pb.Lease]:
            request = pb.AcquireLeaseRequest(
                request_id=secrets.token_hex(8), image=image, wait_timeout=duration_pb(60)
            )
            started = time.perf_counter()
            response = await stub.AcquireLease(request, timeout=120, metadata=metadata)
            return time.perf_counter() - started, response.lease

        async def release(lease: pb.Lease) -> None:
            await stub.ReleaseLease(
                pb.ReleaseLeaseRequest(lease_id=lease.lease_id), timeout=60, metadata=metadata
            )

        progress(f"cold acquires: {samples} (+1 warm-up), each released before the next")
        cold: list[float] = []
        for run in range(samples + 1):
            took, lease = await acquire()
            assert not lease.from_warm_spare
            if run:
                cold.append(took)
            await release(lease)

        progress(f"warm acquires: {samples}; the spare is refilled (untimed) between them")
        warm: list[float] = []
        prewarm = pb.PrewarmRequest(image=image, count=1)
        while len(warm) < samples:
            deadline = time.monotonic() + 120
            while (await stub.Prewarm(prewarm, timeout=10, metadata=metadata)).ready < 1:
                if time.monotonic() > deadline:
                    raise RuntimeError("the spare was not refilled in 120 s")
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # Let the node settle after starting the spare.
            took, lease = await acquire()
            if lease.from_warm_spare:
                warm.append(took)
            await release(lease)
        await stub.Prewarm(pb.PrewarmRequest(image=image, count=0), timeout=10, metadata=metadata)
        # Wait until the last spare is destroyed too, so nothing is left on the node.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            left = await stub.Prewarm(
                pb.PrewarmRequest(image=image, count=0), timeout=10, metadata=metadata
            )
            if not left.pending:
                break
            await asyncio.sleep(0.1)
        return {"cold": cold, "warm": warm}


def part_real(
    args: argparse.Namespace, workdir: Path, cleanup: list[Callable[[], None]], report: dict
) -> None:
    client = docker.from_env()
    cleanup.append(client.close)
    label = "swerl.bench.pool." + secrets.token_hex(4)
    cleanup.append(lambda: remove_leftover_containers(client, {"label": label}))

    print(f"\n(a) baseline: Docker SDK containers.create + start of {args.image}", flush=True)
    baseline = figures(
        "docker create+start", measure_docker_baseline(client, args.image, args.samples, label)
    )

    secret = secrets.token_hex(32)
    node_dir = workdir / "node"
    node_dir.mkdir()
    # The node starts first (its token is made there); the pool shares that token, and the node
    # registers itself once the pool answers.
    pool_address = f"127.0.0.1:{free_port()}"
    node = start_node(
        node_dir,
        "poolbench-",
        ["--pool-address", pool_address, "--capability-secret", secret, "--max-sandboxes", "8"],
        pick_port=True,
    )
    cleanup.append(lambda: shutdown_node(node, client))
    wait_serving(node)
    pool_process = start_pool(
        workdir,
        node.token,
        secret,
        int(pool_address.rsplit(":", 1)[1]),
        ["--maintenance-interval-s", "0.1"],
    )
    cleanup.append(lambda: stop_process(pool_process))

    measured = asyncio.run(measure_acquires(pool_address, node.token, args.image, args.samples))
    print("\n(b) cold AcquireLease (sandbox created on the node)", flush=True)
    cold = figures("cold AcquireLease", measured["cold"])
    overhead = cold["p50_ms"] - baseline["p50_ms"]
    print(
        f"  cold p50 - docker create+start p50 = {overhead:+.1f} ms"
        f"  (target <= +{TARGET_COLD_OVERHEAD_MS:g} ms:"
        f" {verdict(overhead <= TARGET_COLD_OVERHEAD_MS)})"
        f";  cold/docker p50 ratio {cold['p50_ms'] / baseline['p50_ms']:.2f}x",
        flush=True,
    )
    print("\n(c) warm AcquireLease (prewarmed spare bound to the lease)", flush=True)
    warm = figures("warm AcquireLease", measured["warm"])
    print(
        f"  warm p50 {warm['p50_ms']:.2f} ms (target <= {TARGET_WARM_P50_MS:g} ms:"
        f" {verdict(warm['p50_ms'] <= TARGET_WARM_P50_MS)});"
        f" docker create+start p50 / warm p50 = {baseline['p50_ms'] / warm['p50_ms']:.0f}x",
        flush=True,
    )
    report["real"] = {
        "docker_create_start": baseline,
        "cold_acquire": cold,
        "warm_acquire": warm,
        "cold_overhead_ms": overhead,
    }


# ---------------------------------------------------------------------------------------------
# Part 2: control plane at scale, simulated nodes


def serve_simulated(args: argparse.Namespace) -> None:
    """The pool process of part 2: a PoolServer whose nodes are in-process SimulatedNodes."""
    from swerl.chassis.logging import configure_logging
    from swerl.devservers.simulated_nodes import SimulatedNode
    from swerl.pool.server import PoolServer, tune_garbage_collector
    from swerl.pool.settings import PoolSettings

    configure_logging("console", os.environ.get("SWERL_BENCH_POOL_LOG_LEVEL", "warning"))
    nodes = {
        f"sim-{i}:1": SimulatedNode(f"sim-{i}", capacity=SIM_NODE_CAPACITY, images=[SIM_IMAGE])
        for i in range(args.serve_simulated)
    }

    async def main() -> None:
        settings = PoolSettings(
            host="127.0.0.1",
            port=args.port,
            auth_token=os.environ["SWERL_POOL_AUTH_TOKEN"],
            capability_secret=secrets.token_hex(32),
            state_dir=Path(args.state_dir),
            default_ttl_s=30.0,
        )
        server = PoolServer(settings, connect=nodes.__getitem__)
        await server.start()
        tune_garbage_collector(settings)  # As `swerl pool serve` does once started.
        for address, node in nodes.items():
            await server.pool.register_node(node.node_id, address, 0, {})
        print("ready", flush=True)
        await server.serve_until_signal()

    asyncio.run(main())


async def scale_load(address: str, token: str, args: argparse.Namespace, pool_pid: int) -> dict:
    metadata = (("authorization", f"Bearer {token}"),)
    pool_proc = psutil.Process(pool_pid)
    me = psutil.Process()
    channels = [grpc.aio.insecure_channel(address) for _ in range(4)]
    stubs = [pool_pb2_grpc.PoolServiceStub(c) for c in channels]
    await wait_nodes(stubs[0], metadata, args.nodes, timeout_s=300)
    streams = args.streams
    per_stream: list[list[str]] = [[] for _ in range(streams)]
    renewed = [0]
    stop = asyncio.Event()

    async def keepalive(index: int) -> None:
        call = stubs[index % len(stubs)].KeepAlive(metadata=metadata)

        async def reader() -> None:
            async for response in call:
                if response.WhichOneof("kind") == "expiry_batch":
                    renewed[0] += len(response.expiry_batch.expiries)

        read = asyncio.create_task(reader())
        ttl = duration_pb(30)
        # Streams start spread over the second so renewals arrive evenly; each renews all its
        # leases once a second in one KeepAliveRenewBatch (what PoolClient's keeper does).
        await asyncio.sleep(index / streams)
        next_round = time.monotonic()
        while not stop.is_set():
            if per_stream[index]:
                await call.write(
                    pb.KeepAliveRequest(
                        renew_batch=pb.KeepAliveRenewBatch(
                            renews=[
                                pb.KeepAliveRenew(lease_id=lease_id, ttl=ttl)
                                for lease_id in per_stream[index]
                            ]
                        )
                    )
                )
            next_round += 1.0
            await asyncio.sleep(max(0.0, next_round - time.monotonic()))
        await call.done_writing()
        read.cancel()

    keepers = [asyncio.create_task(keepalive(i)) for i in range(streams)]
    ramp: list[float] = []
    semaphore = asyncio.Semaphore(args.concurrency)

    retried = [0]

    async def acquire_one(i: int, into: list[float]) -> str:
        request = pb.AcquireLeaseRequest(
            request_id=f"scale-{i}", image=SIM_IMAGE, wait_timeout=duration_pb(30)
        )
        async with semaphore:
            started = time.perf_counter()
            for attempt in range(5):
                try:
                    response = await stubs[(i + attempt) % len(stubs)].AcquireLease(
                        request, timeout=60, metadata=metadata
                    )
                    break
                except grpc.aio.AioRpcError as err:
                    # Safe to retry: the same request_id gets the same lease.
                    if attempt == 4 or err.code() not in (
                        grpc.StatusCode.CANCELLED,
                        grpc.StatusCode.UNAVAILABLE,
                    ):
                        raise
                    retried[0] += 1
            into.append(time.perf_counter() - started)
            return response.lease.lease_id

    progress(
        f"acquiring {args.leases} leases (concurrency {args.concurrency}), renewing each at 1 Hz"
    )
    started = time.perf_counter()
    pool_cpu0 = pool_proc.cpu_times()
    ramp_renewed0 = renewed[0]
    batch = 1000
    for first in range(0, args.leases, batch):
        ids = await asyncio.gather(
            *(acquire_one(i, ramp) for i in range(first, min(first + batch, args.leases)))
        )
        for offset, lease_id in enumerate(ids):
            per_stream[(first + offset) % streams].append(lease_id)
    ramp_s = time.perf_counter() - started
    pool_cpu1 = pool_proc.cpu_times()
    ramp_cpu = (pool_cpu1.user + pool_cpu1.system - pool_cpu0.user - pool_cpu0.system) / ramp_s
    ramp_renewals = renewed[0] - ramp_renewed0
    progress(f"ramp done in {ramp_s:.1f} s; steady state for {args.steady_s:g} s with probes")

    await asyncio.sleep(2.0)  # Let every stream complete a full round.
    steady: list[float] = []
    renewed0 = renewed[0]
    cpu0, me0, wall0 = pool_proc.cpu_times(), me.cpu_times(), time.perf_counter()
    probe = 0
    while time.perf_counter() - wall0 < args.steady_s:
        probe += 1
        lease_id = await acquire_one(10_000_000 + probe, steady)
        await stubs[0].ReleaseLease(
            pb.ReleaseLeaseRequest(lease_id=lease_id), timeout=30, metadata=metadata
        )
        await asyncio.sleep(0.05)
    wall = time.perf_counter() - wall0
    cpu1, me1 = pool_proc.cpu_times(), me.cpu_times()
    steady_rate = (renewed[0] - renewed0) / wall
    pool_cores = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / wall
    client_cores = (me1.user + me1.system - me0.user - me0.system) / wall
    rss_mb = pool_proc.memory_info().rss / 2**20
    stop.set()
    for task in keepers:
        task.cancel()
    for channel in channels:
        await channel.close()
    # Pool CPU per acquire: the ramp's CPU over its acquires, and the same net of the renewals
    # the pool acknowledged during the ramp (each costed at the steady state's CPU per renewal),
    # which a slower ramp would otherwise add to every acquire.
    ramp_cpu_s = ramp_cpu * ramp_s
    per_renewal_s = pool_cores / steady_rate if steady_rate else 0.0
    return {
        "ramp": ramp,
        "steady": steady,
        "ramp_s": ramp_s,
        "ramp_pool_cores": ramp_cpu,
        "ramp_renewals": ramp_renewals,
        "pool_cpu_ms_per_acquire": 1000 * ramp_cpu_s / args.leases,
        "pool_cpu_ms_per_acquire_net": 1000
        * max(0.0, ramp_cpu_s - per_renewal_s * ramp_renewals)
        / args.leases,
        "pool_cpu_us_per_renewal": 1e6 * per_renewal_s,
        "renewals_per_s": steady_rate,
        "pool_cores": pool_cores,
        "client_cores": client_cores,
        "pool_rss_mb": rss_mb,
        "acquire_retries": retried[0],
    }


def show_log_tail(path: Path, lines: int = 30) -> None:
    """What the pool logged at warning and above, if anything (its log dies with the workdir)."""
    logged = [
        x
        for x in path.read_text(errors="replace").splitlines()
        if x.strip() != "ready" and "code=OK" not in x
    ]
    if logged:
        print(f"[bench] pool log ({len(logged)} lines, last {lines}):")
        print("\n".join("    " + line for line in logged[-lines:]), flush=True)


def part_scale(
    args: argparse.Namespace, workdir: Path, cleanup: list[Callable[[], None]], report: dict
) -> None:
    token = secrets.token_hex(16)
    port = free_port()
    log_path = workdir / "sim-pool.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve-simulated",
                str(args.nodes),
                "--port",
                str(port),
                "--state-dir",
                str(workdir / "sim-pool-state"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "SWERL_POOL_AUTH_TOKEN": token},
            start_new_session=True,
        )
    cleanup.append(lambda: stop_process(process))
    cleanup.append(lambda: show_log_tail(log_path))
    progress(f"started the simulated-node pool (pid {process.pid}), {args.nodes} nodes")
    print(
        f"\n(d) control plane: {args.nodes} simulated nodes, {args.leases} leases, 1 Hz keepalives"
        f" over {args.streams} KeepAlive streams",
        flush=True,
    )
    out = asyncio.run(scale_load(f"127.0.0.1:{port}", token, args, process.pid))
    ramp = figures("AcquireLease during the ramp", out["ramp"])
    steady = figures("AcquireLease at steady state", out["steady"])
    print(
        f"  ramp: {args.leases} leases in {out['ramp_s']:.1f} s"
        f" ({args.leases / out['ramp_s']:.0f}/s), pool {out['ramp_pool_cores']:.2f} cores;"
        f" {out['acquire_retries']} acquires retried (same request_id) after CANCELLED/UNAVAILABLE",
        flush=True,
    )
    print(
        f"  steady: {out['renewals_per_s']:.0f} renewals/s acknowledged"
        f" (wanted {args.leases}/s), pool CPU {out['pool_cores']:.2f} cores"
        f" ({out['pool_cores'] * 100:.0f}% of one core), pool RSS {out['pool_rss_mb']:.0f} MiB,"
        f" load generator {out['client_cores']:.2f} cores",
        flush=True,
    )
    print(
        f"  pool CPU per acquire: {out['pool_cpu_ms_per_acquire']:.2f} ms over the ramp,"
        f" {out['pool_cpu_ms_per_acquire_net']:.2f} ms net of the"
        f" {out['ramp_renewals']} renewals acknowledged meanwhile"
        f" ({out['pool_cpu_us_per_renewal']:.1f} us each at steady state)",
        flush=True,
    )
    print(
        f"  steady acquire p99 {steady['p99_ms']:.2f} ms (target <= {TARGET_SCALE_P99_MS:g} ms:"
        f" {verdict(steady['p99_ms'] <= TARGET_SCALE_P99_MS)})",
        flush=True,
    )
    report["scale"] = {
        "ramp_acquire": ramp,
        "steady_acquire": steady,
        **{k: v for k, v in out.items() if k not in ("ramp", "steady")},
    }


def benchmark(args: argparse.Namespace, workdir: Path, cleanup: list[Callable[[], None]]) -> dict:
    client = docker.from_env()
    facts = machine_facts(client, hardware=True)
    client.close()
    report: dict[str, Any] = {"machine": facts}
    print("machine:", flush=True)
    for key, value in facts.items():
        print(f"  {key:<22} {value}", flush=True)
    if not args.skip_real:
        part_real(args, workdir, cleanup, report)
    if not args.skip_scale:
        part_scale(args, workdir, cleanup, report)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--image", default=DEFAULT_IMAGE)
    parser.add_argument("--samples", type=int, default=20, help="acquires per latency figure")
    parser.add_argument("--nodes", type=int, default=1000, help="simulated nodes")
    parser.add_argument("--leases", type=int, default=20000, help="leases held at scale")
    parser.add_argument(
        "--streams", type=int, default=100, help="KeepAlive streams (holder processes) at scale"
    )
    parser.add_argument("--concurrency", type=int, default=64, help="acquires in flight (ramp)")
    parser.add_argument("--steady-s", type=float, default=15.0, help="steady window, seconds")
    parser.add_argument("--skip-real", action="store_true", help="no Docker part")
    parser.add_argument("--skip-scale", action="store_true", help="no simulated-scale part")
    parser.add_argument("--json", type=Path, help="write the report here")
    # Internal: the pool process of the scale part.
    parser.add_argument("--serve-simulated", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--state-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_simulated:
        serve_simulated(args)
        return 0
    return run_main(args, benchmark, "swerl-pool-bench-")


if __name__ == "__main__":
    sys.exit(main())
