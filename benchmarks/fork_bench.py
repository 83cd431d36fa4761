"""Fork benchmark: ForkSandbox against fresh sandboxes and against re-running the trunk.

    python benchmarks/fork_bench.py [--part exec|agent|all] [--sizes-mb 1,100,1024] [--copies 1,8]
        [--group 8] [--at-turn 5] [--turns 10]

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

The agent part runs a whole loopback stack (pool, exec node, agent, replay policy with the
bundled Qwen3 tokenizer) and a `--turns`-turn replay episode of a bundled task (not graded), as a
group of `--group` samples two ways in the same run: `--group` independent episodes (the
baseline), and one episode branching into `--group` at turn `--at-turn` (EpisodeOptions.branch).
It prints the policy tokens generated each way (counted by the replay server), the saving, and
the (n - 1) x trunk tokens the saving should equal.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid

from swerl.agent import client as agent_client
from swerl.agent.server import local_agent
from swerl.agent.v1 import agent_pb2, agent_pb2_grpc
from swerl.chassis.client import make_channel
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir
from swerl.devservers.replay import ReplayPolicyServer, script_key, submit_turn
from swerl.exec.server import local_node
from swerl.exec.v1 import sandbox_pb2 as pb
from swerl.exec.v1 import sandbox_pb2_grpc
from swerl.stack import local_stack
from swerl.tasks import default_tasks_dir, load_tasks
from swerl.validate import instance_to_pb

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


def _episode_start(task, url: str, episode_id: str, turns: int) -> agent_pb2.EpisodeStart:
    return agent_client.episode_start(
        episode_id=episode_id,
        instance=instance_to_pb(task.instance),
        policy=agent_pb2.PolicyConfig(
            endpoint=url,
            api=agent_pb2.POLICY_API_SGLANG_GENERATE,
            tokenizer_path=str(bundled_qwen3_tokenizer_dir()),
        ),
        limits=agent_client.episode_limits(
            max_turns=turns, max_new_tokens=2048, command_timeout_s=60
        ),
        options=agent_pb2.EpisodeOptions(skip_evaluation=True, owner="fork-bench"),
        sampling_params={"temperature": 1.0, "sampling_seed": 7},
    )


async def _episode(stub, start: agent_pb2.EpisodeStart) -> list[agent_pb2.EpisodeResult]:
    return await agent_client.run_episode(stub, start, timeout=TIMEOUT_S)


async def bench_agent(group: int, at_turn: int, turns: int) -> None:
    task = load_tasks(default_tasks_dir())[0]
    # `turns` policy turns: commands that read and write a little, the last one submitting.
    script = [
        f"Step {i}: looking further.\n\n```bash\nls -la && echo step-{i} >> /tmp/notes\n```"
        for i in range(turns - 1)
    ] + [submit_turn()]
    replay = ReplayPolicyServer(
        {script_key(task.instance["problem_statement"]): script}, keep_requests=True
    )
    url = await replay.start()

    def generated() -> int:
        return sum(len(out) for _, out in replay.stats.requests_seen)

    try:
        async with local_stack(nodes=1, max_sandboxes=group + 1, purpose="fork-bench") as stack:
            async with local_agent(stack.pool_address, stack.token, tokenizer_processes=0) as agent:
                channel = make_channel(agent.address, token=stack.token)
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                try:
                    plain_s, plain = await _timed(
                        asyncio.gather(
                            *(
                                _episode(stub, _episode_start(task, url, f"plain-{i}", turns))
                                for i in range(group)
                            )
                        )
                    )
                    without, calls = generated(), len(replay.stats.requests_seen)
                    branched = _episode_start(task, url, "branched", turns)
                    branched.options.branch.at_turn, branched.options.branch.count = at_turn, group
                    branch_s, results = await _timed(_episode(stub, branched))
                    with_branching = generated() - without
                    # The trunk runs alone before the fork: its calls come first.
                    seen = replay.stats.requests_seen[calls : calls + at_turn]
                    trunk = sum(len(out) for _, out in seen)
                finally:
                    await channel.close()
    finally:
        await replay.stop()
    assert isinstance(plain, list) and isinstance(results, list)
    statuses = [r.status for rs in plain for r in rs] + [r.status for r in results]
    assert len(results) == group and all(
        s == agent_pb2.EPISODE_STATUS_SUBMITTED for s in statuses
    ), statuses
    print(
        f"group of {group}, {turns}-turn replay episode ({task.instance_id}), branching at"
        f" turn {at_turn}; policy tokens generated (replay server's count), same run:"
    )
    print(f"  without branching ({group} episodes): {without:>7} tokens  {plain_s:6.2f} s")
    print(
        f"  with branching (1 trunk, {group} branches): {with_branching:>7} tokens"
        f"  {branch_s:6.2f} s"
    )
    print(
        f"  saved {without - with_branching} tokens = {(without - with_branching) / without:.1%};"
        f" (n - 1) x trunk = {group - 1} x {trunk} = {(group - 1) * trunk};"
        f" ratio with/without {with_branching / without:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("exec", "agent", "all"), default="all")
    parser.add_argument("--sizes-mb", default="1,100,1024")
    parser.add_argument("--copies", default="1,8")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--at-turn", type=int, default=5)
    parser.add_argument("--turns", type=int, default=10)
    args = parser.parse_args()
    if args.part in ("exec", "all"):
        asyncio.run(
            bench(
                [int(s) for s in args.sizes_mb.split(",")],
                [int(c) for c in args.copies.split(",")],
            )
        )
    if args.part in ("agent", "all"):
        asyncio.run(bench_agent(args.group, args.at_turn, args.turns))


if __name__ == "__main__":
    main()
