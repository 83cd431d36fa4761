"""Soak: many scripted episodes over 3 exec nodes, the pool and 2 agents, with faults injected at
random moments, proving that no episode is lost and no sandbox is left behind.

    flock /tmp/swerl-heavy.lock python benchmarks/soak.py --episodes 1000 --faults 20

Every service is a separate process on loopback (`soakkit.SoakCluster`) over a dockerd of the
soak's own. The policies are `swerl replay serve` processes playing gold, wrong, garbage and
destructive (kill every process of the sandbox) scripts over the bundled tasks, gold and wrong
also through native tool calls (agent config `tools`) and through the mini-swe-agent harness
(over the episode's gateway session); each episode picks one at random. Faults, one at a time
at random moments (seeded): SIGKILL and restart of an exec node, of the pool, of an agent;
SIGSTOP of a node for 10 s; the policy answering 500 or hanging; the private dockerd restarted.

Every episode ends one of three ways: a result (any status), an error at the caller (a gRPC
status from the agent, e.g. UNAVAILABLE when the agent was killed), or lost (the caller's own
deadline passed with neither). The run fails (exit 2) on any lost episode, on any sandbox left
once the leases had time to expire, or when the counts do not add up.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import benchkit
import grpc
from soakkit import HARNESS, POLICY_VARIANTS, PrivateDockerd, SoakCluster, variant_parts

from swerl.agent import client as agent_client
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import error_info, make_channel
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir
from swerl.chassis.timeconv import duration_pb
from swerl.tasks import TaskInstance, default_tasks_dir, load_tasks
from swerl.validate import instance_to_pb

FAULT_KINDS = (
    "node_kill",
    "pool_kill",
    "agent_kill",
    "node_stop",
    "policy_error",
    "policy_hang",
    "dockerd_restart",
)
NODE_STOP_S = 10.0
POLICY_FAULT_S = 8.0
# A policy call gets no answer within this, and is sent again (the agent retries a timeout, a
# 5xx answer or a refused connection for up to `policy_connect_max_delay_s`, 60 s, as slime's own
# client does): shorter than a hang window, so a hang is noticed while it lasts, and a window
# shorter than the retry time costs an episode seconds, not its run.
POLICY_REQUEST_TIMEOUT_S = 4.0
WALL_TIMEOUT_S = 120.0
EVAL_TIMEOUT_S = 120.0
# The caller's own deadline: lease wait (60 s) + wall + evaluation + slack. Passing it with
# neither a result nor an error from the agent is what "lost" means.
EPISODE_DEADLINE_S = 60.0 + WALL_TIMEOUT_S + EVAL_TIMEOUT_S + 60.0
# A caller told later than this after a fault gets its own line in the report.
SLOW_TOLD_S = 10.0
# Statuses that are failures of the infrastructure, as far as the caller can tell.
INFRA = "INFRA_ERROR"
_STATUS = {v: k.removeprefix("EPISODE_STATUS_") for k, v in pb.EpisodeStatus.items()}


def say(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class Episode:
    index: int
    variant: str
    task: TaskInstance = field(repr=False)
    episode_id: str = ""
    agent: int = -1
    started: float = 0.0
    ended: float = 0.0
    # "result" | "error" (a gRPC status at the caller) | "lost"
    outcome: str = ""
    # EpisodeStatus name for a result, gRPC code name for an error.
    status: str = ""
    # EpisodeResult.error_reason, or the error's ErrorInfo reason.
    reason: str = ""
    # EpisodeResult.error_message, or the error's details (the first 300 characters).
    message: str = ""

    @property
    def infra_failure(self) -> bool:
        return self.outcome == "error" or self.status == INFRA


@dataclass
class Fault:
    kind: str
    # Fires once this many episodes have ended (and after a random delay).
    at_done: int
    delay_s: float
    target: str = ""
    injected: float = 0.0
    recovered: float = 0.0


def plan_faults(rng: random.Random, count: int, episodes: int) -> list[Fault]:
    """`count` faults: every kind once (in random order) before any repeats, at random points
    of the first 60% of the run, so that all of them fire before the episodes run out."""
    kinds: list[str] = []
    while len(kinds) < count:
        kinds += rng.sample(FAULT_KINDS, len(FAULT_KINDS))
    points = sorted(rng.randint(episodes // 20, max(1, episodes * 6 // 10)) for _ in range(count))
    return [
        Fault(kind, at, round(rng.uniform(0, 3), 2))
        for kind, at in zip(kinds[:count], points, strict=True)
    ]


def episode_start(episode: Episode, policy_url: str) -> pb.EpisodeStart:
    _, kind = variant_parts(episode.variant)
    return agent_client.episode_start(
        episode_id=episode.episode_id,
        instance=instance_to_pb(episode.task.instance),
        policy=pb.PolicyConfig(
            endpoint=policy_url,
            api=pb.POLICY_API_SGLANG_GENERATE,
            model="replay",
            tokenizer_path=str(bundled_qwen3_tokenizer_dir()),
            request_timeout=duration_pb(POLICY_REQUEST_TIMEOUT_S),
        ),
        limits=agent_client.episode_limits(
            max_turns=6,
            # mini-swe-agent's gold reply carries the whole patch (base64) in one tool call
            max_new_tokens=4096 if kind == "mini" else 1024,
            wall_timeout_s=WALL_TIMEOUT_S,
            command_timeout_s=30,
            eval_timeout_s=EVAL_TIMEOUT_S,
        ),
        options=pb.EpisodeOptions(
            owner="soak",
            config_name="tools" if kind == "tools" else "",
            harness=HARNESS if kind == "mini" else "",
        ),
        sampling_params={"temperature": 1.0},
    )


class Soak:
    def __init__(self, args: argparse.Namespace, cluster: SoakCluster) -> None:
        self.args = args
        self.cluster = cluster
        self.rng = random.Random(args.seed)
        tasks = load_tasks(default_tasks_dir())
        self.episodes = [
            Episode(i, self.rng.choice(POLICY_VARIANTS), self.rng.choice(tasks))
            for i in range(args.episodes)
        ]
        self.faults = plan_faults(self.rng, args.faults, args.episodes)
        self.agent_up = [True] * cluster.agents
        self.channels: list[grpc.aio.Channel] = []
        self.next_agent = 0
        self.done = 0
        self.t0 = 0.0
        self.memory_before: dict[str, int] = {}
        self.faults_over = asyncio.Event()  # every planned fault injected (or given up)
        # Fault kind -> reasons of the failures attributed to it (filled by `attribute`).
        self.reasons_by_fault: dict[str, Counter[str]] = {}

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- episodes -------------------------------------------------------------------------
    async def pick_agent(self) -> int:
        # An agent being restarted is skipped, as a load balancer's health check would; the
        # wait is bounded by the restart's own bound.
        deadline = time.monotonic() + 180
        while not any(self.agent_up):
            if time.monotonic() > deadline:
                raise RuntimeError("no agent came back within 180 s")
            await asyncio.sleep(0.1)
        while True:
            index = self.next_agent % len(self.agent_up)
            self.next_agent += 1
            if self.agent_up[index]:
                return index

    async def run_episode(self, episode: Episode) -> None:
        episode.agent = await self.pick_agent()
        episode.episode_id = f"soak-{episode.index}-{uuid.uuid4().hex[:8]}"
        start = episode_start(episode, self.cluster.policy_urls[episode.variant])
        stub = agent_pb2_grpc.AgentServiceStub(self.channels[episode.agent])
        episode.started = self.now()
        result = None
        try:
            results = await agent_client.run_episode(stub, start, timeout=EPISODE_DEADLINE_S)
            result = results[-1] if results else None
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                episode.outcome, episode.status = "lost", "DEADLINE_EXCEEDED"
            else:
                episode.outcome, episode.status = "error", code.name
                episode.reason = error_info(err)[0] or ""
                episode.message = (err.details() or "")[:300]
        else:
            if result is None:
                episode.outcome, episode.status = "lost", "NO_RESULT"
            else:
                episode.outcome, episode.status = "result", _STATUS[result.status]
                episode.reason = result.error_reason
                episode.message = result.error_message[:300]
        episode.ended = self.now()
        self.done += 1
        if self.done == max(1, len(self.episodes) // 20) and not self.memory_before:
            # "Before" is taken once the services are warm (tokenizers loaded, first leases).
            self.memory_before = await asyncio.to_thread(self.cluster.memory)

    async def feed(self) -> None:
        queue: asyncio.Queue[Episode] = asyncio.Queue()
        for episode in self.episodes:
            queue.put_nowait(episode)

        # The last fifth of the episodes starts only once every planned fault was injected
        # (faults fall in the first 60%): on a fast machine the episodes could otherwise all
        # end before the last faults, which then hit nothing.
        held_from = len(self.episodes) * 8 // 10

        async def worker() -> None:
            while not queue.empty():
                episode = queue.get_nowait()
                if episode.index >= held_from:
                    await self.faults_over.wait()
                await self.run_episode(episode)

        await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))

    # -- faults ---------------------------------------------------------------------------
    async def inject_faults(self) -> None:
        try:
            await self._inject_planned_faults()
        finally:
            self.faults_over.set()

    async def _inject_planned_faults(self) -> None:
        for fault in self.faults:
            while self.done < fault.at_done and self.done < len(self.episodes):  # noqa: ASYNC110 - polls a counter, bounded by the run
                await asyncio.sleep(0.1)
            if self.done >= len(self.episodes):
                say(f"run ended before fault {fault.kind}; not injected")
                return
            await asyncio.sleep(fault.delay_s)
            await self.inject(fault)
            say(
                f"fault {fault.kind} {fault.target} at {fault.injected:.1f} s,"
                f" recovered at {fault.recovered:.1f} s"
            )

    async def inject(self, fault: Fault) -> None:
        cluster = self.cluster
        if fault.kind in ("node_kill", "node_stop"):
            index = self.rng.randrange(cluster.nodes)
            node = cluster.node_procs[index]
            fault.target = node.name
            fault.injected = self.now()
            if fault.kind == "node_kill":
                await asyncio.to_thread(node.kill)
                await asyncio.sleep(2.0)
                await asyncio.to_thread(node.start)
            else:
                node.signal(signal.SIGSTOP)
                await asyncio.sleep(NODE_STOP_S)
                node.signal(signal.SIGCONT)
            await asyncio.to_thread(cluster.wait_nodes_healthy)
        elif fault.kind == "pool_kill":
            fault.target = "pool"
            fault.injected = self.now()
            await asyncio.to_thread(cluster.pool.kill)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(cluster.pool.start)
            await asyncio.to_thread(cluster.wait_nodes_healthy)
        elif fault.kind == "agent_kill":
            index = self.rng.randrange(cluster.agents)
            fault.target = cluster.agent_procs[index].name
            self.agent_up[index] = False
            fault.injected = self.now()
            await asyncio.to_thread(cluster.agent_procs[index].kill)
            await asyncio.to_thread(cluster.agent_procs[index].start)
            await asyncio.to_thread(cluster.wait_agent_serving, index)
            old, self.channels[index] = self.channels[index], self.open_channel(index)
            await old.close()
            self.agent_up[index] = True
        elif fault.kind in ("policy_error", "policy_hang"):
            fault.target = "all policies"
            fault.injected = self.now()
            mode = fault.kind.removeprefix("policy_")
            await asyncio.to_thread(cluster.policy_fault, mode, POLICY_FAULT_S)
            await asyncio.sleep(POLICY_FAULT_S)
        elif fault.kind == "dockerd_restart":
            fault.target = "dockerd"
            fault.injected = self.now()
            await asyncio.to_thread(cluster.dockerd.restart)
            await asyncio.to_thread(cluster.wait_nodes_healthy)
        else:
            raise ValueError(f"unknown fault {fault.kind}")
        fault.recovered = self.now()

    # -- the run --------------------------------------------------------------------------
    def open_channel(self, index: int) -> grpc.aio.Channel:
        return make_channel(self.cluster.agent_addresses[index], token=self.cluster.token)

    async def report_progress(self) -> None:
        while True:
            await asyncio.sleep(self.args.progress_s)
            ended = [e for e in self.episodes if e.outcome]
            counts = Counter(e.outcome for e in ended)
            infra = sum(e.infra_failure for e in ended)
            running = sum(1 for e in self.episodes if e.started and not e.outcome)
            injected = sum(1 for f in self.faults if f.recovered)
            say(
                f"{len(ended)}/{len(self.episodes)} ended (results {counts['result']},"
                f" errors {counts['error']}, lost {counts['lost']}, infra {infra}),"
                f" running {running}, faults {injected}/{len(self.faults)}"
            )

    async def run(self) -> None:
        self.channels = [self.open_channel(i) for i in range(self.cluster.agents)]
        self.t0 = time.monotonic()
        progress = asyncio.create_task(self.report_progress())
        faults = asyncio.create_task(self.inject_faults())
        try:
            await self.feed()
            # A fault still recovering must finish: the cluster is whole before the checks.
            await faults
        finally:
            progress.cancel()
            faults.cancel()
            for channel in self.channels:
                await channel.close()
        self.wall_s = self.now()


def wait_sandboxes_gone(cluster: SoakCluster, bound_s: float) -> tuple[list[str], float]:
    """Waits (bounded) until no sandbox is left; returns what is left and the seconds waited.
    Leases of killed agents end when their TTL passes with no keepalive, so the bound is a
    TTL plus the pool's slack and reaping."""
    started = time.monotonic()
    while True:
        left = cluster.dockerd.sandboxes()
        if not left or time.monotonic() - started > bound_s:
            return left, time.monotonic() - started
        time.sleep(1.0)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


# Which faults can end an episode with a given reason (or a caller's gRPC code); reasons not
# listed (sandbox, lease, evaluation) can come from any fault of the nodes, the pool or dockerd.
_SANDBOX_FAULTS = ("node_kill", "node_stop", "pool_kill", "dockerd_restart")
_CAUSES = {
    "UNAVAILABLE": ("agent_kill",),
    "POLICY_ERROR": ("policy_error",),
    "POLICY_UNAVAILABLE": ("policy_hang",),
    "SANDBOX_UNAVAILABLE": _SANDBOX_FAULTS,
    # The node's own reasons, which the agent now passes on: Docker stopped the container under
    # a command (a dockerd restarting), or dockerd did not answer.
    "SANDBOX_STOPPED": ("dockerd_restart",),
    "DOCKER_UNAVAILABLE": ("dockerd_restart",),
    "SANDBOX_NOT_RUNNING": _SANDBOX_FAULTS,
    "LEASE_LOST": _SANDBOX_FAULTS,
    "LEASE_UNAVAILABLE": _SANDBOX_FAULTS,
    "EVALUATION_UNAVAILABLE": _SANDBOX_FAULTS,
}


# What the node told the agent, inside the agent's message, names the fault more precisely than
# the agent's reason does: a dockerd that went away, or the node's socket closed under a call.
_NODE_CAUSES = (
    ("DOCKER_UNAVAILABLE", ("dockerd_restart",)),
    ("Socket closed", ("node_kill",)),
    ("Connection reset by peer", ("node_kill",)),
    # The lease channel's pings went unanswered: the node was stopped.
    ("ping timeout", ("node_stop",)),
)


def _causes(episode: Episode) -> tuple[str, ...]:
    causes = _CAUSES.get(episode.reason or episode.status, ())
    if causes is _SANDBOX_FAULTS:
        for needle, precise in _NODE_CAUSES:
            if needle in episode.message:
                return precise
    return causes


def attribute(
    soak: Soak,
) -> tuple[dict[str, list[float]], list[Episode], list[str], list[str]]:
    """Each infra failure goes to a fault that hit the episode while it ran (injected before
    it ended, not recovered before it started) and can cause what the caller was told (an
    agent's UNAVAILABLE to agent_kill, POLICY_ERROR to policy_error, ...), the first such one:
    a later fault only finds the episode broken already. Its "told" latency is the time from
    the fault (or the episode's start, when it started during the fault) to its end. Returns the
    latencies by fault kind, the failures no fault explains, one line per failure, and the
    lines of the callers told more than SLOW_TOLD_S after their fault."""
    told: dict[str, list[float]] = {f.kind: [] for f in soak.faults}
    soak.reasons_by_fault = {f.kind: Counter() for f in soak.faults}
    unexplained = []
    lines: list[str] = []
    slow: list[str] = []
    for episode in soak.episodes:
        if not episode.infra_failure:
            continue
        hits = [
            f
            for f in soak.faults
            if f.recovered and f.injected <= episode.ended and f.recovered >= episode.started
        ]
        what = (
            f"{episode.episode_id} {episode.variant} agent-{episode.agent}"
            f" {episode.started:.1f}-{episode.ended:.1f} s {episode.status} {episode.reason}"
        )
        if not hits:
            unexplained.append(episode)
            lines.append(f"{what}: no fault ({episode.message})")
            continue
        causes = [f for f in hits if f.kind in _causes(episode)]
        fault = min(causes or hits, key=lambda f: f.injected)
        latency = episode.ended - max(fault.injected, episode.started)
        told[fault.kind].append(latency)
        soak.reasons_by_fault[fault.kind][episode.reason or episode.status] += 1
        line = f"{what}: {fault.kind} {fault.target} +{latency:.2f} s ({episode.message})"
        lines.append(line)
        if latency > SLOW_TOLD_S:
            slow.append(line)
    return told, unexplained, lines, slow


def summarize(soak: Soak, left: list[str], waited_s: float, memory_after: dict[str, int]) -> dict:
    episodes = soak.episodes
    started = sum(1 for e in episodes if e.started)
    outcomes = Counter(e.outcome for e in episodes)
    told, unexplained, detail, slow = attribute(soak)
    all_told = [x for values in told.values() for x in values]
    injected = [f for f in soak.faults if f.recovered]
    restarts = {p.name: p.starts - 1 for p in soak.cluster.services}
    restarts["dockerd"] = soak.cluster.dockerd.proc.starts - 1
    return {
        "seed": soak.args.seed,
        "episodes": len(episodes),
        "concurrency": soak.args.concurrency,
        "wall_s": round(soak.wall_s, 1),
        "started": started,
        "finished_with_result": outcomes["result"],
        "ended_with_error_at_caller": outcomes["error"],
        "lost": outcomes["lost"],
        "statuses": dict(Counter(e.status for e in episodes if e.outcome == "result")),
        "caller_errors": dict(
            Counter(f"{e.status} {e.reason}".strip() for e in episodes if e.outcome == "error")
        ),
        "by_variant": {
            v: dict(Counter(e.status for e in episodes if e.variant == v)) for v in POLICY_VARIANTS
        },
        "infra_reasons": dict(Counter(e.reason or e.status for e in episodes if e.infra_failure)),
        "infra_failures": sum(e.infra_failure for e in episodes),
        # The destructive policy kills its own sandbox: what follows is its doing, not a fault's.
        "infra_unexplained": [
            f"{e.episode_id} {e.variant} {e.status} {e.reason} ({e.message})"
            for e in unexplained
            if e.variant != "destructive"
        ],
        "destructive_unexplained": [
            f"{e.episode_id} {e.status} {e.reason}"
            for e in unexplained
            if e.variant == "destructive"
        ],
        # A harness that failed on gold or wrong scripts: what the harness said (a fault that
        # ends a harness episode must be told as infra, not as the harness's failure).
        "harness_failed": [
            f"{e.episode_id} {e.variant} +{e.ended:.1f} s ({e.message})"
            for e in episodes
            if e.status == "HARNESS_FAILED"
        ],
        "infra_detail": detail,
        "told_late": slow,
        "faults_planned": len(soak.faults),
        "faults_injected": len(injected),
        "faults": [asdict(f) for f in soak.faults],
        "fault_kinds_injected": sorted({f.kind for f in injected}),
        "told_s": {k: [round(x, 3) for x in v] for k, v in told.items()},
        # Fault kind -> how many were injected, and the INFRA_ERRORs and caller errors each
        # caused, by reason (what the caller was told).
        "by_fault": {
            kind: {
                "injected": sum(1 for f in injected if f.kind == kind),
                "errors": len(told[kind]),
                "reasons": dict(soak.reasons_by_fault[kind]),
            }
            for kind in told
        },
        "told_p50_s": round(percentile(all_told, 50), 2),
        "told_p99_s": round(percentile(all_told, 99), 2),
        "told_max_s": round(max(all_told, default=0.0), 2),
        "sandboxes_left": left,
        "sandbox_wait_s": round(waited_s, 1),
        "memory_before_bytes": soak.memory_before,
        "memory_after_bytes": memory_after,
        "restarts": restarts,
        # One row per episode: id, policy, agent, start and end (s into the run), outcome,
        # status, reason; enough to redo any figure above.
        "episode_rows": [
            [
                e.episode_id,
                e.variant,
                e.agent,
                round(e.started, 3),
                round(e.ended, 3),
                e.outcome,
                e.status,
                e.reason,
            ]
            for e in episodes
        ],
        "lost_episodes": [
            f"{e.episode_id} {e.variant} agent-{e.agent} {e.status}"
            for e in episodes
            if e.outcome == "lost"
        ],
    }


def print_report(r: dict) -> None:
    mib = 1 << 20
    rule = "-" * 78
    print(rule)
    print(
        f"soak: {r['episodes']} episodes, concurrency {r['concurrency']}, seed {r['seed']},"
        f" wall {r['wall_s']} s"
    )
    total = r["finished_with_result"] + r["ended_with_error_at_caller"] + r["lost"]
    print(f"  episodes started                       {r['started']:6d}")
    print(f"  finished with a result                 {r['finished_with_result']:6d}")
    print(f"  ended with a precise error at caller   {r['ended_with_error_at_caller']:6d}")
    print(f"  lost                                   {r['lost']:6d}")
    verdict = "ok" if total == r["started"] == r["episodes"] else "MISMATCH"
    print(f"  sum                                    {total:6d}  ({verdict})")
    print("  result statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(r["statuses"].items())))
    if r["caller_errors"]:
        print("  caller errors:   " + ", ".join(f"{k} {v}" for k, v in r["caller_errors"].items()))
    print("  by policy:")
    for variant, counts in r["by_variant"].items():
        print(f"    {variant:12s} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(
        f"  INFRA_ERROR + caller errors {r['infra_failures']} against"
        f" {r['faults_injected']}/{r['faults_planned']} faults injected;"
        f" with no fault to explain them: {len(r['infra_unexplained'])}"
        f" (+{len(r['destructive_unexplained'])} of the destructive policy)"
    )
    for line in r["infra_unexplained"]:
        print(f"    unexplained: {line}")
    for line in r["harness_failed"]:
        print(f"    harness failed: {line}")
    print("  infra reasons:   " + ", ".join(f"{k} {v}" for k, v in r["infra_reasons"].items()))
    print(f"  {'fault':16s} {'target':13s} {'at s':>7s} {'recov s':>8s}")
    for f in r["faults"]:
        print(f"  {f['kind']:16s} {f['target']:13s} {f['injected']:7.1f} {f['recovered']:8.1f}")
    print(
        f"  {'fault kind':16s} {'faults':>6s} {'callers told':>12s} {'per fault':>9s}"
        f" {'p50 s':>7s} {'p99 s':>7s} {'max s':>7s}  reasons"
    )
    for kind, values in r["told_s"].items():
        row = r.get("by_fault", {}).get(kind, {"injected": 0, "reasons": {}})
        per = len(values) / row["injected"] if row["injected"] else 0.0
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(row["reasons"].items())) or "-"
        if values:
            print(
                f"  {kind:16s} {row['injected']:6d} {len(values):12d} {per:9.1f}"
                f" {percentile(values, 50):7.2f} {percentile(values, 99):7.2f}"
                f" {max(values):7.2f}  {reasons}"
            )
        else:
            print(f"  {kind:16s} {row['injected']:6d} {0:12d} {per:9.1f}")
    print(
        f"  fault -> affected callers told: p50 {r['told_p50_s']} s, p99 {r['told_p99_s']} s,"
        f" max {r['told_max_s']} s"
    )
    # Callers told late are what an operator would chase: each one on a line.
    for line in r["told_late"]:
        print(f"    told late: {line}")
    print(
        f"  sandboxes left after the run           {len(r['sandboxes_left']):6d}"
        f"  (waited {r['sandbox_wait_s']} s for lease expiry)"
    )
    print(f"  {'memory (RSS MiB)':20s} {'before':>8s} {'after':>8s} {'restarts':>9s}")
    for name, after in r["memory_after_bytes"].items():
        before = r["memory_before_bytes"].get(name, 0)
        print(f"  {name:20s} {before / mib:8.1f} {after / mib:8.1f} {r['restarts'][name]:9d}")
    for lost in r["lost_episodes"]:
        print(f"  LOST: {lost}")
    for name in r["sandboxes_left"]:
        print(f"  LEFT: {name}")
    print(rule, flush=True)


def failures(r: dict) -> list[str]:
    found = []
    if r["lost"]:
        found.append(f"{r['lost']} episodes lost")
    if r["sandboxes_left"]:
        found.append(f"{len(r['sandboxes_left'])} sandboxes left")
    # Every INFRA_ERROR (and caller error) has a cause: one no fault explains is a finding.
    if r.get("infra_unexplained"):
        found.append(f"{len(r['infra_unexplained'])} infra failures no fault explains")
    total = r["finished_with_result"] + r["ended_with_error_at_caller"] + r["lost"]
    if not total == r["started"] == r["episodes"]:
        found.append(f"counts do not add up: {total} ended, {r['started']} started")
    return found


def soak_main(args: argparse.Namespace, workdir: Path, cleanup: list[Callable[[], None]]) -> dict:
    say(f"seed {args.seed}, {args.episodes} episodes, {args.faults} faults, workdir {workdir}")
    dockerd = PrivateDockerd(workdir / "d")
    cleanup.append(dockerd.destroy)
    dockerd.start()
    started = time.monotonic()
    dockerd.load_images([args.base_image])
    tasks = load_tasks(default_tasks_dir())
    dockerd.build_task_images(tasks, args.base_image)
    say(
        f"private dockerd up; base image loaded, {len(tasks)} task images built in"
        f" {time.monotonic() - started:.1f} s"
    )
    cluster = SoakCluster(workdir, dockerd, lease_ttl_s=args.lease_ttl_s)
    cleanup.append(cluster.stop)
    started = time.monotonic()
    cluster.start()
    say(f"cluster up in {time.monotonic() - started:.1f} s: 3 nodes, pool, 2 agents, 4 policies")
    soak = Soak(args, cluster)
    asyncio.run(soak.run())
    say("episodes done; waiting for every sandbox to be destroyed")
    cluster.wait_nodes_healthy()
    left, waited = wait_sandboxes_gone(cluster, args.lease_ttl_s + 60.0)
    report = summarize(soak, left, waited, cluster.memory())
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        for log in [*workdir.glob("*.log"), dockerd.proc.log_path]:
            shutil.copy(log, args.logs / log.name)
    print_report(report)
    report["failures"] = failures(report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--faults", type=int, default=14, help="faults injected, one at a time")
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--concurrency", type=int, default=8, help="episodes running at once")
    parser.add_argument("--lease-ttl-s", type=float, default=30.0)
    parser.add_argument("--progress-s", type=float, default=10.0, help="seconds between lines")
    parser.add_argument("--base-image", default="swerl-base:bookworm")
    parser.add_argument("--json", type=Path, help="write the report here as JSON")
    parser.add_argument("--logs", type=Path, help="copy every service's log to this directory")
    args = parser.parse_args(argv)
    if args.episodes < 1 or args.concurrency < 1:
        parser.error("--episodes and --concurrency must be at least 1")
    if args.faults < 0:
        parser.error("--faults must be 0 or more")
    if args.seed is None:
        args.seed = random.randrange(1 << 31)
    outcome: dict[str, Any] = {}

    def run(args: argparse.Namespace, workdir: Path, cleanup: list[Callable[[], None]]) -> dict:
        outcome.update(soak_main(args, workdir, cleanup))
        return outcome

    status = benchkit.run_main(args, run, "swsoak-")
    if status == 0 and outcome.get("failures"):
        say("FAILED: " + "; ".join(outcome["failures"]))
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
