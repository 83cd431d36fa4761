"""Groups kept: how many GRPO prompt groups survive injected infra failures, with and without the
trainer plugin's infra re-runs (trainer_plugin/reruns.py).

    python benchmarks/group_keep.py --groups 500 --group-size 8 --infra-rate 0.05

The plugin's real hooks (`generate`, then `filter_infra_failures` per group) run against a real
grpc.aio AgentService on loopback that ends each episode INFRA_ERROR (LEASE_LOST) with
probability `--infra-rate`, independently per attempt (seeded), and otherwise submits a small
trajectory. No training framework is imported: the plugin's framework-free path takes the
benchmark's own Sample. Each configuration runs the same number of groups; the report gives the
groups the filter kept, the episodes run and the extra episodes the re-runs cost, beside the
expected figures ((1 - p)^n without re-runs, (1 - p^k)^n with k attempts).

The failures are injected at the agent's boundary, so this measures what the plugin does with
them (the agent's own causes of INFRA_ERROR are exercised by tests/agent and benchmarks/soak.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import grpc
import structlog

from swerl.agent.v1 import agent_pb2, agent_pb2_grpc
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir
from swerl.trainer_plugin import filter_infra_failures, generate

INSTANCE = {
    "instance_id": "swerl-examples__listutils-14",
    "repo": "swerl-examples/listutils",
    "version": "0.1",
    "base_commit": "abc123",
    "problem_statement": "chunk() drops the last partial chunk",
    "FAIL_TO_PASS": '["tests/test_chunk.py::test_partial"]',
    "PASS_TO_PASS": ["tests/test_chunk.py::test_even"],
}
PROMPT = [151644, 8948, 198, 151645, 198, 151644, 872, 198]


@dataclass
class Sample:
    """The fields of a framework sample the plugin reads and writes."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False
    weight_versions: list[str] = field(default_factory=list)
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    non_generation_time: float = 0.0


class FlakyAgent(agent_pb2_grpc.AgentServiceServicer):
    """Ends each episode INFRA_ERROR with probability `rate`, else submits three turns."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate = rate
        self.rng = random.Random(seed)
        self.episodes = 0
        self.failed = 0

    async def RunEpisode(self, request_iterator: Any, context: Any) -> Any:
        start = (await anext(aiter(request_iterator))).start
        self.episodes += 1
        yield agent_pb2.RunEpisodeResponse(
            started=agent_pb2.EpisodeStarted(lease_id="lease", sandbox_id="sbx", node_id="n")
        )
        result = agent_pb2.EpisodeResult(episode_id=start.episode_id)
        if self.rng.random() < self.rate:
            self.failed += 1
            result.status = agent_pb2.EPISODE_STATUS_INFRA_ERROR
            result.error_reason, result.error_message = "LEASE_LOST", "injected"
        else:
            result.status = agent_pb2.EPISODE_STATUS_SUBMITTED
            result.reward = 1.0 if self.rng.random() < 0.5 else -1.0
            record = result.trajectory
            record.prompt_ids.extend(PROMPT)
            for turn in range(3):
                record.response_ids.extend([1000 + turn, 1001 + turn, 2000 + turn])
                record.loss_mask.extend([1, 1, 0])
                record.logprobs.extend([-0.5, -0.25, 0.0])
            record.reward = result.reward
        yield agent_pb2.RunEpisodeResponse(result=result)


@dataclass
class Figures:
    attempts: int
    groups: int
    kept: int
    episodes: int
    failed_attempts: int
    seconds: float


async def run_config(args: argparse.Namespace, attempts: int, seed: int) -> Figures:
    agent = FlakyAgent(args.infra_rate, seed)
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(agent, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    plugin_args = argparse.Namespace(
        sglang_router_ip="127.0.0.1",
        sglang_router_port=30000,
        hf_checkpoint=str(bundled_qwen3_tokenizer_dir()),
        rollout_max_context_len=16384,
        n_samples_per_prompt=args.group_size,
        swerl_agent_addresses=[f"127.0.0.1:{port}"],
        swerl_episode_attempts=attempts,
        swerl_abort_poll_interval_s=0.05,
    )
    params = {"temperature": 1.0, "max_new_tokens": 256, "sampling_seed": 7}
    gate = asyncio.Semaphore(args.concurrency)

    async def member(group: int, i: int) -> Any:
        sample = Sample(
            group_index=group,
            index=group * args.group_size + i,
            prompt=INSTANCE["problem_statement"],
            metadata={"instance": dict(INSTANCE), "data_source": "bench"},
        )
        async with gate:
            return await generate(plugin_args, sample, dict(params))

    async def one_group(group: int) -> bool:
        outs = await asyncio.gather(*(member(group, i) for i in range(args.group_size)))
        return bool(filter_infra_failures(plugin_args, list(outs)).keep)

    began = time.monotonic()
    kept = await asyncio.gather(*(one_group(g) for g in range(args.groups)))
    seconds = time.monotonic() - began
    await server.stop(0)
    return Figures(attempts, args.groups, sum(kept), agent.episodes, agent.failed, seconds)


def report(args: argparse.Namespace, runs: list[Figures]) -> None:
    p, n = args.infra_rate, args.group_size
    base = args.groups * n
    print(
        f"group_keep: {args.groups} groups of {n}, infra failures injected at {p:.1%} per "
        f"episode attempt (seed {args.seed})"
    )
    print(
        f"{'attempts':>8} {'groups kept':>12} {'expected':>9} {'episodes run':>13} "
        f"{'extra':>6} {'extra %':>8} {'failed attempts':>16} {'wall s':>7}"
    )
    for r in runs:
        expected = (1 - p**r.attempts) ** n
        extra = r.episodes - base
        print(
            f"{r.attempts:>8} {r.kept / r.groups:>12.2%} {expected:>9.2%} {r.episodes:>13} "
            f"{extra:>6} {extra / base:>8.2%} {r.failed_attempts:>16} {r.seconds:>7.1f}"
        )
    without, with_reruns = runs[0], runs[-1]
    print(
        f"groups kept without re-runs {without.kept}/{without.groups}, with "
        f"{with_reruns.attempts} attempts {with_reruns.kept}/{with_reruns.groups}; "
        f"extra episodes run {with_reruns.episodes - base} "
        f"({(with_reruns.episodes - base) / base:.2%} of {base})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=500)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--infra-rate", type=float, default=0.05)
    parser.add_argument("--attempts", type=int, default=3, help="attempts with re-runs")
    parser.add_argument("--concurrency", type=int, default=64, help="episodes in flight")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # The plugin logs every failed and re-run episode: keep the report readable.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    runs = [
        asyncio.run(run_config(args, attempts, args.seed))
        for attempts in sorted({1, args.attempts})
    ]
    report(args, runs)
    kept = Counter({r.attempts: r.kept / r.groups for r in runs})
    return 0 if kept[max(kept)] >= 0.99 or args.attempts == 1 else 2


if __name__ == "__main__":
    sys.exit(main())
