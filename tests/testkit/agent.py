"""Helpers of the agent tests: a whole loopback stack (pool, exec node, agent, replay policy),
start messages for the bundled tasks, and the token invariants every record must satisfy."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from swerl.agent.server import AgentServer, local_agent
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import make_channel
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir
from swerl.chassis.timeconv import duration_pb
from swerl.devservers.replay import ReplayPolicyServer, replay_logprob
from swerl.pool.client import PoolClient
from swerl.pool.v1 import pool_pb2
from swerl.stack import LocalStack, local_stack
from swerl.tasks import TaskInstance, default_tasks_dir, load_tasks
from swerl.validate import instance_to_pb
from testkit.exec import remove_containers_of

TOKENIZER_DIR = str(bundled_qwen3_tokenizer_dir())
# The node ids of this test process's stacks begin with this: each pytest-xdist worker has its
# own, so its no-sandbox-left checks and its sweep of an earlier run's sandboxes count only the
# sandboxes of its own stacks, never those of a worker running beside it on the same dockerd.
STACK_PURPOSE = f"agent-test-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"


def bundled_tasks() -> list[TaskInstance]:
    return load_tasks(default_tasks_dir())


@dataclass
class AgentStack:
    stack: LocalStack
    agent: AgentServer
    stub: agent_pb2_grpc.AgentServiceStub
    channel: object


# The nodes of this worker's ended agent stacks, whose containers the next stack removes.
_LEFT_BY_EARLIER: list[str] = []


@contextlib.asynccontextmanager
async def agent_stack(
    max_sandboxes: int = 8, judge_factory=None, **agent_settings
) -> AsyncIterator[AgentStack]:
    # Tokenizing in threads keeps the tests' start-up short; the e2e gold test uses processes.
    agent_settings.setdefault("tokenizer_processes", 0)
    while _LEFT_BY_EARLIER:
        await asyncio.to_thread(remove_containers_of, _LEFT_BY_EARLIER.pop())
    async with local_stack(nodes=1, max_sandboxes=max_sandboxes, purpose=STACK_PURPOSE) as stack:
        async with local_agent(
            stack.pool_address, stack.token, judge_factory=judge_factory, **agent_settings
        ) as agent:
            channel = make_channel(agent.address, token=stack.token)
            try:
                yield AgentStack(stack, agent, agent_pb2_grpc.AgentServiceStub(channel), channel)
            except BaseException:
                # A test that failed midway leaves its sandboxes to no one once its stack is gone:
                # they go with it, so the next test starts on a clean dockerd (its own
                # no-sandbox-left checks would otherwise fail for this one).
                for node in stack.nodes:
                    await asyncio.to_thread(remove_containers_of, str(node.settings.node_id))
                raise
            finally:
                await channel.close()
    # A test that passed may still leave a sandbox behind (one made as the stack stopped): its
    # own check names it, and it is removed here, after that check had its chance, only when
    # the next agent_stack of this worker starts (below), so it fails no later test's
    # worker-wide `sandboxes_left()` (CI, 7 Dec: one leak failed ten tests after it).
    _LEFT_BY_EARLIER.extend(str(node.settings.node_id) for node in stack.nodes)


def start_for(
    task: TaskInstance,
    policy_url: str,
    episode_id: str,
    *,
    max_turns: int = 8,
    dynamic_history: bool = False,
    artifact_dir: str = "",
    max_context_tokens: int = 0,
    command_timeout_s: float = 60.0,
) -> pb.EpisodeStart:
    start = pb.EpisodeStart(
        episode_id=episode_id,
        instance=instance_to_pb(task.instance),
        policy=pb.PolicyConfig(
            endpoint=policy_url,
            api=pb.POLICY_API_SGLANG_GENERATE,
            model="replay",
            tokenizer_path=TOKENIZER_DIR,
        ),
        limits=pb.EpisodeLimits(
            max_turns=max_turns,
            max_new_tokens=2048,
            max_context_tokens=max_context_tokens,
            command_timeout=duration_pb(command_timeout_s),
            eval_timeout=duration_pb(300),
        ),
        options=pb.EpisodeOptions(
            dynamic_history=dynamic_history, artifact_dir=artifact_dir, owner="agent-test"
        ),
    )
    start.policy.sampling_params.update({"temperature": 1.0, "top_p": 1.0})
    return start


async def run_to_result(stub, start: pb.EpisodeStart) -> list[pb.RunEpisodeResponse]:
    messages = []
    call = stub.RunEpisode(iter([pb.RunEpisodeRequest(start=start)]), timeout=600)
    async for message in call:
        messages.append(message)
    return messages


def result_of(messages: list[pb.RunEpisodeResponse]) -> pb.EpisodeResult:
    results = [m.result for m in messages if m.WhichOneof("kind") == "result"]
    assert len(results) == 1, [m.WhichOneof("kind") for m in messages]
    assert messages[-1].WhichOneof("kind") == "result"
    return results[0]


def check_record(record: pb.TokenRecord, replay: ReplayPolicyServer | None = None) -> None:
    """slime's invariants, and: mask-1 tokens carry the logprobs the replay server sent."""
    n = len(record.response_ids)
    assert record.prompt_ids, "empty prompt"
    assert n >= 1
    assert len(record.loss_mask) == n and len(record.logprobs) == n
    position = 0
    for mask, logprob in zip(record.loss_mask, record.logprobs, strict=True):
        assert mask in (0, 1)
        if mask == 0:
            assert logprob == 0.0
            position = 0
        else:
            assert abs(logprob - replay_logprob(position)) < 1e-6
            position += 1


async def until_running(sandbox_id: str, command: str, timeout_s: float = 60.0) -> None:
    """Waits until `command` runs inside the sandbox's container (`docker top`), so that a fault
    injected next lands under that command rather than between two commands: a container killed
    while idle is started again by the next command, which is another test."""
    deadline = time.monotonic() + timeout_s
    while True:
        top = await asyncio.to_thread(
            subprocess.run,
            ["docker", "top", f"swerl-{sandbox_id}", "-o", "pid,args"],
            capture_output=True,
            text=True,
        )
        processes = [line.split(None, 1) for line in top.stdout.splitlines()[1:]]
        if any(len(p) == 2 and command in p[1] for p in processes):
            return
        assert time.monotonic() < deadline, f"{command!r} never ran in {sandbox_id}: {top}"
        await asyncio.sleep(0.05)


def swerl_sandboxes() -> list[tuple[str, str]]:
    """Every swerl sandbox container on the dockerd, as (container id, node id)."""
    out = subprocess.run(
        [
            "docker",
            "ps",
            "-a",
            "--filter",
            "label=swerl.node",
            "--format",
            '{{.ID}} {{.Label "swerl.node"}}',
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [(row[0], row[1]) for row in map(str.split, out.splitlines()) if len(row) == 2]


def sandboxes_left(node_id_prefix: str = STACK_PURPOSE + "-") -> list[str]:
    return [node for _, node in swerl_sandboxes() if node.startswith(node_id_prefix)]


def node_of(env: AgentStack) -> str:
    """The id of the stack's one exec node (other runs on a shared dockerd use the same
    STACK_PURPOSE prefix, so a test checks its own node only)."""
    (node,) = env.stack.nodes
    return str(node.settings.node_id)


async def assert_no_active_lease(env: AgentStack) -> None:
    """The stack's pool holds no ACTIVE lease."""
    pool = PoolClient(env.stack.pool_address, token=env.stack.token)
    try:
        active = [x for x in await pool.list_leases() if x.state == pool_pb2.LEASE_STATE_ACTIVE]
        assert active == [], active
    finally:
        await pool.close()


class LoopIterations:
    """Numbers the running event loop's iterations: `now` is the current one's (a task that
    takes one step per iteration counts them), from `async with` to its end."""

    def __init__(self) -> None:
        self.now = 0
        self._counter: asyncio.Future[None] | None = None

    async def _count(self) -> None:
        while True:
            await asyncio.sleep(0)  # one step per loop iteration
            self.now += 1

    async def __aenter__(self) -> LoopIterations:
        self._counter = asyncio.ensure_future(self._count())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._counter is not None
        self._counter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._counter
