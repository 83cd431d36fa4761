"""Fork benchmark: ForkSandbox against fresh sandboxes and against re-running the trunk.

    python benchmarks/fork_bench.py [--sizes-mb 1,100,1024] [--copies 1,8]

Starts an in-process exec node (insecure, loopback, throwaway state dir) over the local dockerd.
For each size it makes a source sandbox of the base image whose "trunk" writes that many MB of
random bytes (the changes a trunk leaves: a working tree, installed packages), then measures, in
the same run:

  (a) ForkSandbox of the source into 1 and into 8 copies (commit of the writable layer + creates),
  (b) the baseline: 1 and 8 fresh create+starts of the task image (concurrent, as the fork's),
  (c) re-running the trunk instead of forking: 1 and 8 fresh sandboxes that each run the trunk's
      command again,

and prints the ratios fork / fresh and fork / re-run. Target (issue 18): a fork of a 100 MB change
into 8 copies takes at most 2x the time of 8 fresh create+starts. It reports; it does not
assert. Every sandbox is destroyed on the way out; fork images go with their last copy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid

from swerl.exec.server import local_node
from swerl.exec.v1 import sandbox_pb2 as pb
from swerl.exec.v1 import sandbox_pb2_grpc

BASE_IMAGE = os.environ.get("SWERL_BASE_IMAGE", "swerl-base:bookworm")
TIMEOUT_S = 900.0


async def _create(stub: sandbox_pb2_grpc.SandboxServiceStub) -> str:
    request = pb.CreateSandboxRequest(image=BASE_IMAGE, workdir="/tmp", request_id=uuid.uuid4().hex)
    return (await stub.CreateSandbox(request, timeout=TIMEOUT_S)).sandbox.sandbox_id


async def _run(stub: sandbox_pb2_grpc.SandboxServiceStub, sandbox_id: str, command: str) -> None:
    start = pb.ExecStart(sandbox_id=sandbox_id, command=command)
    start.timeout.FromSeconds(int(TIMEOUT_S))
    async for response in stub.Exec(iter([pb.ExecRequest(start=start)]), timeout=TIMEOUT_S):
        if response.WhichOneof("kind") == "exit":
            if response.exit.exit_code != 0:
                raise RuntimeError(f"{command!r} exited {response.exit.exit_code}")
            return


async def _destroy(stub: sandbox_pb2_grpc.SandboxServiceStub, ids: list[str]) -> None:
    await asyncio.gather(
        *(
            stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=i), timeout=TIMEOUT_S)
            for i in ids
        )
    )


async def _timed(coro) -> tuple[float, object]:
    began = time.perf_counter()
    result = await coro
    return time.perf_counter() - began, result


async def bench(sizes_mb: list[int], copies: list[int]) -> None:
    async with local_node("forkbench") as (_, channel):
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        print(f"image {BASE_IMAGE}; times in seconds (one run each, same node, same dockerd)")
        header = f"{'change':>8} {'copies':>6} {'fork':>8} {'fresh':>8} {'re-run':>8}"
        print(header + f" {'fork/fresh':>10} {'fork/re-run':>11}")
        for size in sizes_mb:
            trunk = f"head -c {size}M /dev/urandom > /tmp/trunk.bin && sync"
            source = await _create(stub)
            await _run(stub, source, trunk)
            for n in copies:
                fork_s, forked = await _timed(
                    stub.ForkSandbox(
                        pb.ForkSandboxRequest(sandbox_id=source, count=n), timeout=TIMEOUT_S
                    )
                )
                assert isinstance(forked, pb.ForkSandboxResponse)
                fresh_s, fresh = await _timed(asyncio.gather(*(_create(stub) for _ in range(n))))
                assert isinstance(fresh, list)

                async def rerun(trunk: str = trunk) -> str:
                    sandbox_id = await _create(stub)
                    await _run(stub, sandbox_id, trunk)
                    return sandbox_id

                rerun_s, reruns = await _timed(asyncio.gather(*(rerun() for _ in range(n))))
                assert isinstance(reruns, list)
                print(
                    f"{size:>6}MB {n:>6} {fork_s:>8.2f} {fresh_s:>8.2f} {rerun_s:>8.2f}"
                    f" {fork_s / fresh_s:>10.2f} {fork_s / rerun_s:>11.2f}"
                )
                await _destroy(stub, [s.sandbox_id for s in forked.sandboxes] + fresh + reruns)
            await _destroy(stub, [source])
        print("target: fork of a 100 MB change into 8 copies <= 2.00 x 8 fresh create+starts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="1,100,1024")
    parser.add_argument("--copies", default="1,8")
    args = parser.parse_args()
    asyncio.run(
        bench([int(s) for s in args.sizes_mb.split(",")], [int(c) for c in args.copies.split(",")])
    )


if __name__ == "__main__":
    main()
