"""Agent benchmark: per-turn token bookkeeping cost, and event-loop stalls under load.

1. Bookkeeping: one episode's per-turn CPU work with the real Qwen3 tokenizer and template
   (next prompt within a 32k-token budget, decode the response, parse the action, render the
   observation, its template delta, the records), averaged over turns 1-5 and over turns 46-50
   of a 50-turn episode whose context reaches the 32k budget. Target: <= 3 ms per turn, ratio
   late/early <= 1.5. Baseline in the same run: re-rendering and re-tokenizing the whole
   history every turn (what the predecessor did), whose cost grows with the history.
2. Stalls: 256 concurrent episodes on one event loop through the agent's runner, policy = the
   replay server (SGLang /generate, Qwen3 tokenizer) in a separate process, sandboxes from an
   in-memory provider behind the agent's SandboxProvider Protocol (no Docker: the figure is the
   agent's own loop). A ticker measures the worst lateness of the loop. Target: < 20 ms.
   Baseline: the same ticker on an idle loop.
3. Tool calls (the `tools` agent config): both measurements again with the replies written as
   Qwen3 tool calls (parsed, each call answered by its own tool message, the tool messages'
   template delta appended) instead of bash blocks, in the same run. Target: bookkeeping per
   turn and the worst stall within 1.2x of the bash-block figures.

4. Harness episodes (`--harness mini-swe-agent`): the same episodes (in-memory sandboxes, the
   replay policy in its own process, tool calls of a `bash` tool, `--turns` turns each) driven by
   swerl's own loop (`tools` config) and by the real mini-swe-agent through its gateway
   session, in the same run: episodes per minute and the agent process's CPU per turn (its
   threads included; tokenizing in threads for both, so all of it is counted), and the ratio.

5. A real engine (`--engine vllm --policy-url URL`, benchmarks/engine_overhead.py): per-turn
   bookkeeping of scripted episodes on the replay and on vLLM (forced to the same turns), and
   the policy client's overhead over a direct /inference/v1/generate (and /generate) call, in one
   run, with the versions and the machine's load.

    python benchmarks/agent_bench.py [--episodes 256] [--turns 10]
    python benchmarks/agent_bench.py --harness mini-swe-agent [--harness-episodes 32]
    python benchmarks/agent_bench.py --engine vllm --policy-url http://127.0.0.1:8431
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import statistics
import sys
import time

import aiohttp
from benchkit import free_port, progress

from swerl.agent.actions.bash_block import parse_action, render_observation
from swerl.agent.actions.tool_turn import parse_sampled
from swerl.agent.actions.toolcalls import CallIds, get_tool_call_format
from swerl.agent.config import load_config
from swerl.agent.policy.context import ContextPolicy, ContextWindow
from swerl.agent.policy.tokens import ChatCodec, Trajectory
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir, load_tokenizer

CONTEXT = 32_768
MAX_NEW = 2_048


def _episode_texts(turns: int) -> list[tuple[str, str]]:
    """(response, command output) pairs: ~130-token replies and ~400-token outputs."""
    pairs = []
    for i in range(turns):
        response = (
            f"Turn {i}: the failure points at the parser; let me inspect the function that "
            "handles quoted values and the tests that cover it, then narrow it down further. "
            * 2
            + f"\n\n```bash\nsed -n '{i * 10},{i * 10 + 60}p' src/parser/core_{i}.py\n```"
        )
        output = "\n".join(
            f"{i * 10 + n:5d}    value = self._read_token(stream, quote={n % 3}) or default"
            for n in range(60)
        )
        pairs.append((response, output))
    return pairs


def _tool_texts(turns: int) -> list[tuple[str, str]]:
    """The same turns as tool calls: the same reasoning text, then a bash call."""
    qwen = get_tool_call_format("qwen25")
    return [
        (
            response.split("\n\n```bash")[0]
            + "\n"
            + qwen.render_call("bash", {"command": response.split("```bash\n")[1][:-4]}),
            output,
        )
        for response, output in _episode_texts(turns)
    ]


def _incremental(codec, config, system, user, pairs, responses):
    prompt = codec.render_prompt(system, user)
    trajectory = Trajectory(prompt)
    window = ContextWindow(
        prompt,
        codec.header_ids,
        lambda n: codec.user_message_ids(config.render("omission_template", n_omitted=n)),
        ContextPolicy(CONTEXT),
    )
    costs, cpu, sizes, trimmed_turns = [], [], [], []
    for index, ((_, output), ids) in enumerate(zip(pairs, responses, strict=True)):
        started, started_cpu = time.perf_counter(), time.thread_time()
        sent, trimmed = window.next_prompt(MAX_NEW)
        if trimmed:
            trimmed_turns.append(index + 1)
        text = codec.decode(ids)
        observation = render_observation(
            config, exit_code=0, output=output, timed_out=False, timeout_s=180, turns_left=None
        )
        trajectory.add_turn(sent, ids, [-0.1] * len(ids), "v1")
        if config.tool_calls:
            parsed = parse_sampled(text, config, "stop", CallIds(seed=index))
            assert len(parsed.runnable) == 1
            replies = [
                {"role": "tool", "tool_call_id": call.id, "content": observation}
                for call in parsed.runnable
            ]
            trajectory.set_delta(codec.messages_delta(ids, replies))
        else:
            action = parse_action(text)
            assert action.command is not None
            trajectory.set_delta(codec.observation_delta(ids, observation))
        window.append(trajectory.units[-1])
        costs.append(time.perf_counter() - started)
        cpu.append(time.thread_time() - started_cpu)
        sizes.append(len(sent))
    for record in trajectory.whole_records():
        record.check()
    return costs, cpu, sizes, trimmed_turns


def bookkeeping(turns: int = 50, config_name: str = "") -> dict[str, float]:
    config = load_config(config_name)
    codec = ChatCodec(load_tokenizer(bundled_qwen3_tokenizer_dir()), config.template_kwargs())
    system = config.render("system_template")
    user = config.render("instance_template", task="Quoted values lose their escapes. " * 40)
    pairs = _tool_texts(turns) if config.tool_calls else _episode_texts(turns)
    responses = [[*codec.encode(r), codec.end_of_turn_id] for r, _ in pairs]

    # Incremental bookkeeping (what the agent does). Three runs; per turn the fastest counts
    # (as timeit does), since the shared machine's other work only ever adds time.
    runs = [_incremental(codec, config, system, user, pairs, responses) for _ in range(3)]
    costs = [min(run[0][i] for run in runs) for i in range(turns)]
    cpu = [min(run[1][i] for run in runs) for i in range(turns)]
    sizes, trimmed_turns = runs[0][2], runs[0][3]

    # Baseline: render and tokenize the whole conversation again every turn.
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    naive = []
    for (response, output), _ in zip(pairs, responses, strict=True):
        started = time.perf_counter()
        ids = codec.encode(
            codec.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **config.template_kwargs()
            )
        )
        observation = render_observation(
            config, exit_code=0, output=output, timed_out=False, timeout_s=180, turns_left=None
        )
        messages += [
            {"role": "assistant", "content": response},
            {"role": "user", "content": observation},
        ]
        naive.append(time.perf_counter() - started)
        del ids
    early, late = statistics.mean(costs[:5]) * 1e3, statistics.mean(costs[-5:]) * 1e3
    early_cpu, late_cpu = statistics.mean(cpu[:5]) * 1e3, statistics.mean(cpu[-5:]) * 1e3
    naive_early = statistics.mean(naive[:5]) * 1e3
    naive_late = statistics.mean(naive[-5:]) * 1e3
    return {
        "context_tokens_at_turn_50": sizes[-1],
        "trims_at_turns": ",".join(map(str, trimmed_turns)),
        "ms_per_turn_turns_1_5": early,
        "ms_per_turn_turns_46_50": late,
        "ratio_late_over_early": late / early,
        "cpu_ms_per_turn_turns_1_5": early_cpu,
        "cpu_ms_per_turn_turns_46_50": late_cpu,
        "cpu_ratio_late_over_early": late_cpu / early_cpu,
        "ms_per_turn_all_50_median": statistics.median(costs) * 1e3,
        # A turn that trims the context costs more; the two protocols trim at different turns.
        "cpu_ms_per_turn_untrimmed_median": statistics.median(
            c for i, c in enumerate(cpu) if i + 1 not in trimmed_turns
        )
        * 1e3,
        "baseline_rerender_ms_turns_1_5": naive_early,
        "baseline_rerender_ms_turns_46_50": naive_late,
        "baseline_ratio_late_over_early": naive_late / naive_early,
        "speedup_vs_rerender_at_turn_50": naive_late / late,
    }


# -- stalls ----------------------------------------------------------------------------------


def _bench_script(turns: int, tool_calls: bool = False, harness: str = "") -> list[str]:
    if harness == "mini-swe-agent":  # its one `bash` tool, its own submission
        qwen = get_tool_call_format("qwen25")
        steps = [f"cat src/module_{i}.py" for i in range(turns - 2)]
        steps += [
            "git add -A && git diff --cached --binary > patch.txt",
            "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat patch.txt",
        ]
        return [
            f"Step {i}.\n" + qwen.render_call("bash", {"command": step})
            for i, step in enumerate(steps)
        ]
    if tool_calls:
        qwen = get_tool_call_format("qwen25")
        body = [
            f"Step {i}: reading more of the module.\n"
            + qwen.render_call("bash", {"command": f"cat src/module_{i}.py"})
            for i in range(turns - 1)
        ]
        return [*body, "Done.\n" + qwen.render_call("submit", {})]
    body = [
        f"Step {i}: reading more of the module.\n\n```bash\ncat src/module_{i}.py\n```"
        for i in range(turns - 1)
    ]
    submit = (
        "Done.\n\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A"
        " && git diff --cached --binary\n```"
    )
    return [*body, submit]


def _serve_replay(
    port: int, turns: int, ready, tool_calls: bool = False, harness: str = ""
) -> None:
    import os

    from swerl.devservers.replay import ReplayPolicyServer

    # The policy server stands for GPUs on other machines: it must not compete with the agent
    # for this machine's cores.
    os.nice(19)

    async def main() -> None:
        server = ReplayPolicyServer(
            {"Benchmark issue": _bench_script(turns, tool_calls, harness)},
            port=port,
            threads=2,
            latency_s=0.05,
        )
        await server.start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


class MemorySandbox:
    """An in-memory sandbox: commands answer ~2 KB after 20 ms; evaluation resolves."""

    def __init__(self, index: int) -> None:
        self.lease_id = f"lease-{index}"
        self.sandbox_id = f"sbx-{index}"
        self.node_id = "memory"
        self.lost = asyncio.Event()

    def lost_detail(self) -> tuple[str, str]:
        return ("UNSPECIFIED", "")

    async def run(self, command: str, *, timeout_s, env, cwd, stdin=None):
        from swerl.exec.client import ExecResult

        await asyncio.sleep(0.02)
        command = command.removeprefix("exec 2>&1\n")  # mini-swe-agent's merged output
        if command.startswith("echo COMPLETE_TASK"):
            out = b"COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\ndiff --git a/x b/x\n"
        elif command.startswith("git add -A"):  # the `submit` tool
            out = b"diff --git a/x b/x\n"
        else:
            out = ("def handler(request):\n    return respond(request.body)\n" * 40).encode()
        return ExecResult(
            exit_code=0,
            stdout=out,
            stderr=b"",
            timed_out=False,
            output_truncated=False,
            bytes_dropped=0,
            duration_s=0.02,
            signaled=False,
        )

    async def diff(self) -> bytes:
        return b""

    async def evaluate(self, instance, patch, timeout_s):
        from swerl.exec.v1 import evaluate_pb2

        await asyncio.sleep(0.05)
        return evaluate_pb2.EvaluationReport(status=evaluate_pb2.EVALUATION_STATUS_RESOLVED_FULL)


class MemoryProvider:
    def __init__(self) -> None:
        self.count = 0

    @contextlib.asynccontextmanager
    async def lease(self, image, *, owner, instance_id, request_id, workdir, avoid_node_ids=()):
        self.count += 1
        yield MemorySandbox(self.count)


async def _ticker(stop: asyncio.Event, lateness: list[float], period: float = 0.005) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        expected = loop.time() + period
        await asyncio.sleep(period)
        lateness.append(loop.time() - expected)


async def stalls(
    episodes: int,
    turns: int,
    cpu_threads: int = 4,
    tokenizer_processes: int = 2,
    config_name: str = "",
    harness: str = "",
) -> dict[str, float]:
    from swerl.agent.client import episode_limits, episode_start
    from swerl.agent.loop.runner import EpisodeRunner
    from swerl.agent.settings import AgentSettings
    from swerl.agent.v1 import agent_pb2 as pb
    from swerl.exec.v1 import evaluate_pb2

    idle: list[float] = []
    stop = asyncio.Event()
    ticker = asyncio.ensure_future(_ticker(stop, idle))
    await asyncio.sleep(2.0)
    stop.set()
    await ticker

    port = free_port()
    ready = multiprocessing.Event()
    tool_calls = load_config(config_name).tool_calls
    replay = multiprocessing.Process(
        target=_serve_replay, args=(port, turns, ready, tool_calls, harness), daemon=True
    )
    replay.start()
    try:
        if not await asyncio.to_thread(ready.wait, 120):
            raise RuntimeError("the replay server did not start")
        settings = AgentSettings(
            insecure=True,
            port=0,
            cpu_threads=cpu_threads,
            tokenizer_processes=tokenizer_processes,
            log_level="warning",
        )
        runner = EpisodeRunner(settings, MemoryProvider())
        tokenizer = str(bundled_qwen3_tokenizer_dir())
        # Loaded once, as a warm agent has it.
        await runner.codec(tokenizer, load_config(config_name).template_kwargs())

        async def one(index: int) -> pb.EpisodeResult:
            start = episode_start(
                episode_id=f"bench-{index}",
                instance=evaluate_pb2.SweInstance(
                    instance_id=f"bench__{index}",
                    image_name="memory",
                    problem_statement=f"Benchmark issue {index}: handler drops bodies.",
                    fail_to_pass=["t"],
                ),
                policy=pb.PolicyConfig(
                    endpoint=f"http://127.0.0.1:{port}", tokenizer_path=tokenizer
                ),
                limits=episode_limits(max_turns=turns + 2, max_new_tokens=1024),
                options=pb.EpisodeOptions(config_name=config_name, harness=harness),
            )

            async def requests():
                yield pb.RunEpisodeRequest(start=start)

            result = None
            async for message in runner.stream(requests()):
                if message.WhichOneof("kind") == "result":
                    result = message.result
            assert result is not None
            return result

        # A serving agent is warm: first-call costs (imports, the HTTP session) stay out.
        await asyncio.gather(*(one(-1 - i) for i in range(4)))
        lateness: list[float] = []
        stop = asyncio.Event()
        ticker = asyncio.ensure_future(_ticker(stop, lateness))
        started, cpu_started = time.monotonic(), time.process_time()
        results = await asyncio.gather(*(one(i) for i in range(episodes)))
        elapsed = time.monotonic() - started
        cpu_s = time.process_time() - cpu_started
        stop.set()
        await ticker
        await runner.close()
    finally:
        replay.kill()
        replay.join()
    submitted = sum(1 for r in results if r.status == pb.EPISODE_STATUS_SUBMITTED)
    turns_done = sum(int(r.metrics["turns"]) for r in results)
    worst_at = lateness.index(max(lateness)) / max(len(lateness), 1)
    lateness.sort()
    return {
        "worst_stall_at_fraction_of_run": worst_at,
        "episodes": episodes,
        "submitted": submitted,
        "turns": turns_done,
        "wall_s": elapsed,
        "turns_per_s": turns_done / elapsed,
        "episodes_per_min": episodes * 60.0 / elapsed,
        "agent_cpu_ms_per_turn": cpu_s * 1e3 / max(turns_done, 1),
        "idle_loop_worst_stall_ms": max(idle) * 1e3,
        "worst_stall_ms": lateness[-1] * 1e3,
        "p99_stall_ms": lateness[int(len(lateness) * 0.99)] * 1e3,
        "stall_ratio_vs_idle": lateness[-1] / max(max(idle), 1e-4),
    }


def _print(figures: dict) -> None:
    for key, value in figures.items():
        print(f"  {key:40} {value:10.3f}" if isinstance(value, float) else f"  {key:40} {value}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--skip-stalls", action="store_true")
    parser.add_argument("--skip-bookkeeping", action="store_true")
    parser.add_argument("--cpu-threads", type=int, default=4)
    parser.add_argument("--tokenizer-processes", type=int, default=2)
    parser.add_argument(
        "--harness", default="", help="compare this harness with swerl's loop (mini-swe-agent)"
    )
    parser.add_argument("--harness-episodes", type=int, default=32)
    parser.add_argument(
        "--engine", choices=["vllm"], help="measure swerl around this real engine (5.)"
    )
    parser.add_argument("--policy-url", help="with --engine: the engine's base URL")
    parser.add_argument("--engine-episodes", type=int, default=3)
    parser.add_argument("--engine-calls", type=int, default=20)
    args = parser.parse_args()
    if args.harness:
        return compare_harness(args)
    if args.engine:
        if not args.policy_url:
            parser.error("--engine vllm needs --policy-url of a running engine")
        return asyncio.run(compare_engines(args))
    if not args.skip_bookkeeping:
        progress("bookkeeping: 50 turns, 32k-token budget, real Qwen3 tokenizer and template")
        book = bookkeeping()
        _print(book)
        ok = book["ms_per_turn_turns_46_50"] <= 3.0 and book["ratio_late_over_early"] <= 1.5
        print(f"  target <= 3 ms/turn and ratio <= 1.5: {'met' if ok else 'NOT met'}")
        progress("bookkeeping with tool calls (agent config `tools`), same turns")
        tools = bookkeeping(config_name="tools")
        _print(tools)
        for key in (
            "ms_per_turn_turns_1_5",
            "ms_per_turn_turns_46_50",
            "cpu_ms_per_turn_turns_1_5",
            "cpu_ms_per_turn_turns_46_50",
            "cpu_ms_per_turn_untrimmed_median",
        ):
            ratio = tools[key] / book[key]
            verdict = "met" if ratio <= 1.2 else "NOT met"
            print(f"  tool calls / bash block, {key}: {ratio:.3f} (target <= 1.2: {verdict})")
    if not args.skip_stalls:
        figures = {}
        for name, label in (("", "bash block"), ("tools", "tool calls")):
            progress(
                f"stalls ({label}): {args.episodes} concurrent episodes x {args.turns} turns,"
                " one loop"
            )
            figures[name] = asyncio.run(
                stalls(
                    args.episodes,
                    args.turns,
                    args.cpu_threads,
                    args.tokenizer_processes,
                    config_name=name,
                )
            )
            _print(figures[name])
            met = figures[name]["worst_stall_ms"] < 20.0
            print(f"  target worst stall < 20 ms: {'met' if met else 'NOT met'}")
        ratio = figures["tools"]["worst_stall_ms"] / figures[""]["worst_stall_ms"]
        verdict = "met" if ratio <= 1.2 else "NOT met"
        print(f"  tool calls / bash block, worst stall: {ratio:.3f} (target <= 1.2: {verdict})")
    return 0


def compare_harness(args: argparse.Namespace) -> int:
    """Measurement 4: swerl's loop and `args.harness` on the same episodes, same run."""
    figures = {}
    for harness, config in (("builtin", "tools"), (args.harness, "")):
        progress(
            f"harness {harness}: {args.harness_episodes} concurrent episodes x {args.turns}"
            " turns, in-memory sandboxes, replay policy"
        )
        figures[harness] = asyncio.run(
            stalls(
                args.harness_episodes,
                args.turns,
                args.cpu_threads,
                0,
                config_name=config,
                harness=harness,
            )
        )
        _print(figures[harness])
    ours, theirs = figures["builtin"], figures[args.harness]
    for key in ("episodes_per_min", "agent_cpu_ms_per_turn", "worst_stall_ms"):
        ratio = theirs[key] / max(ours[key], 1e-9)
        pair = f"{theirs[key]:.2f} / {ours[key]:.2f}"
        print(f"  {args.harness} / builtin, {key}: {pair} = {ratio:.2f}")
    return 0


async def compare_engines(args: argparse.Namespace) -> int:
    """Measurement 5: swerl around the replay and around the vLLM engine, same run."""
    import engine_overhead as eo
    from benchkit import load_line, software_line

    from swerl.agent.policy.clients import SglangPolicy
    from swerl.agent.policy.vllm import VllmPolicy
    from swerl.agent.v1 import agent_pb2 as pb
    from swerl.devservers.forcing import ForcingProxy
    from swerl.devservers.replay import ReplayPolicyServer

    engine = args.policy_url.rstrip("/")
    async with aiohttp.ClientSession() as session, session.get(engine + "/version") as answer:
        vllm_version = (await answer.json()).get("version", "?")
    print(f"  {software_line(eo.ENGINE_DISTRIBUTIONS)}; vLLM engine {vllm_version} at {engine}")
    print(f"  {load_line()} at the start")
    script = {eo.SCRIPT_KEY: _bench_script(args.turns)}
    replay = ReplayPolicyServer(script, threads=2)
    forcing = ForcingProxy(engine, script)
    replay_url, forced_url = await replay.start(), await forcing.start()
    try:
        book = {}
        for name, url, api in (
            ("replay", replay_url, pb.POLICY_API_SGLANG_GENERATE),
            ("vllm", forced_url, pb.POLICY_API_VLLM_GENERATE),
        ):
            progress(
                f"bookkeeping on {name}: {args.engine_episodes} scripted episodes x"
                f" {args.turns} turns, one at a time, in-memory sandboxes"
            )
            book[name] = await eo.scripted_episodes(
                url, api, args.engine_episodes, args.turns, MemoryProvider()
            )
            _print(book[name])
        ratio = book["vllm"]["overhead_ms_per_turn_median"] / max(
            book["replay"]["overhead_ms_per_turn_median"], 1e-9
        )
        print(f"  vllm / replay, swerl's overhead per turn: {ratio:.2f}")
        params = {"temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}
        vllm_params = {"temperature": 1.0, "seed": 7, "ignore_eos": True}
        clients = (
            (
                "replay",
                lambda s: SglangPolicy(s, replay_url, params, request_timeout_s=60),
                eo.sglang_direct_body(params),
                replay_url + "/generate",
            ),
            (
                "vllm",
                lambda s: VllmPolicy(s, engine, params, request_timeout_s=60),
                eo.vllm_direct_body(vllm_params, ""),
                engine + "/inference/v1/generate",
            ),
        )
        for name, make, body, url in clients:
            progress(
                f"policy client on {name}: {args.engine_calls} calls each way, 512-token prompt,"
                " 16 new tokens"
            )
            _print(await eo.client_overhead(make, body, url, args.engine_calls, 512, 16))
    finally:
        await forcing.stop()
        await replay.stop()
    print(f"  {load_line()} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
