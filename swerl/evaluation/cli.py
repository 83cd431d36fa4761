"""`swerl eval`: a policy on a dataset through agent, pool and exec nodes; see `--help`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from swerl.chassis.logging import configure_logging
from swerl.data.naming import CONVENTIONS

_MAX_MESSAGE = 256 << 20  # results carry whole token trajectories


@contextlib.asynccontextmanager
async def _agent(args: argparse.Namespace) -> AsyncIterator[tuple[str, str | None]]:
    """The agent's address and bearer token: remote, over a remote pool, or all in-process."""
    if args.agent:
        yield args.agent, args.token
        return
    from swerl.agent.server import local_agent

    # The in-process agent serves the model gateway (issue 26), so harness episodes and
    # anything else the run starts can open sessions on it (OpenSession).
    gateway = {"gateway_port": args.gateway_port}
    if args.pool:
        async with local_agent(args.pool, args.token or "", **gateway) as agent:
            _say_gateway(agent)
            yield agent.address, args.token
        return
    from swerl.stack import local_stack

    node_ids: list[str] = []
    try:
        async with (
            local_stack(
                nodes=args.nodes,
                # A branching episode holds its trunk's sandbox and its forks on one node.
                max_sandboxes=max(2, args.concurrency * (2 + (args.branches or 0))),
                purpose=args.stack_name or f"eval-{os.getpid()}",
            ) as stack,
            local_agent(stack.pool_address, stack.token, **gateway) as agent,
        ):
            _say_gateway(agent)
            node_ids = [node.settings.node_id for node in stack.nodes]
            yield agent.address, stack.token
    finally:
        # A sandbox whose creation was still under way when an interrupted run stopped its
        # nodes escapes their cleanup; these nodes never come back to reap it, so sweep here.
        await asyncio.to_thread(_remove_sandboxes_of, node_ids)


def _say_gateway(agent: Any) -> None:
    if agent.gateway is not None:
        print(f"swerl eval: model gateway on {agent.gateway.url}", file=sys.stderr, flush=True)


def _remove_sandboxes_of(node_ids: list[str]) -> None:
    if not node_ids:
        return
    import docker

    client = docker.from_env()
    try:
        for node_id in node_ids:
            for container in client.api.containers(
                all=True, filters={"label": f"swerl.node={node_id}"}
            ):
                with contextlib.suppress(docker.errors.NotFound):
                    client.api.remove_container(container["Id"], force=True, v=True)
    finally:
        client.close()


@contextlib.asynccontextmanager
async def _policy(args: argparse.Namespace, tasks: list[Any]) -> AsyncIterator[str]:
    if args.script:
        async with _forced_engine(args, tasks) as url:
            yield url
        return
    if not args.replay:
        yield args.policy_url
        return
    from swerl.devservers.replay import ReplayPolicyServer, scripts_for_tasks

    garbage = args.replay == "garbage"
    # A `tool_calls` config gets scripts written as tool calls in its parser's format.
    parser = _tool_call_parser(args)
    server = ReplayPolicyServer(
        {}
        if garbage
        else scripts_for_tasks(tasks, args.replay, tool_call_parser=parser, harness=args.harness),
        tokenizer_dir=args.tokenizer,
        garbage=garbage,
        latency_s=args.replay_latency,
    )
    url = await server.start()
    try:
        yield url
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def _forced_engine(args: argparse.Namespace, tasks: list[Any]) -> AsyncIterator[str]:
    """The real vLLM engine at --policy-url, each turn forced to the task's --script turn
    (swerl.devservers.forcing): the engine samples it and the agent records what it sampled."""
    from swerl.devservers.forcing import ForcingProxy
    from swerl.devservers.replay import scripts_for_tasks

    proxy = ForcingProxy(
        args.policy_url,
        scripts_for_tasks(tasks, args.script, tool_call_parser=_tool_call_parser(args)),
        forcing=args.forcing,
        tokenizer_dir=args.tokenizer,
    )
    url = await proxy.start()
    try:
        yield url
    finally:
        await proxy.stop()


def _tool_call_parser(args: argparse.Namespace) -> str:
    """A `tool_calls` config's parser (its scripts are written as its tool calls), or ""."""
    if not args.config_name:
        return ""
    from swerl.agent.config import load_config

    config = load_config(args.config_name)
    return config.tool_call_parser if config.tool_calls else ""


def _script_problem(args: argparse.Namespace) -> str | None:
    """Why --script cannot run (None: it can, or was not asked for)."""
    if not args.script:
        return None
    if args.replay:
        return "--script forces a real engine; --replay is the in-process stand-in, not both"
    if args.policy_api != "vllm":
        return "--script needs --policy-api vllm (its structured outputs force the turns)"
    if not args.dataset.is_dir():
        return "--script plays scripts of a tasks directory"
    if args.agent:
        return "--script needs the agent in this process (--agent sends it elsewhere)"
    if args.harness:
        return "--script plays swerl's own loop's scripts, not a --harness"
    return None


async def _run(args: argparse.Namespace) -> int:
    from swerl.chassis.client import make_channel
    from swerl.evaluation.dataset import load_instances, select
    from swerl.evaluation.results import OutputDir
    from swerl.evaluation.runner import EvalConfig, Progress, run_all

    loaded = load_instances(
        args.dataset, convention=args.image_convention, registry_prefix=args.registry_prefix
    )
    if loaded.skipped and not loaded.instances:
        # Nothing to run: the input is wrong, not the run; one line names the first bad row.
        print(f"swerl eval: no row can be graded; {loaded.first_problem}", file=sys.stderr)
        return 2
    if loaded.skipped:
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(loaded.skipped.items()))
        print(
            f"skipped {sum(loaded.skipped.values())} rows that cannot be graded: {reasons}"
            f" (first: {loaded.first_problem})"
        )
    chosen = select(
        loaded.instances,
        instance_ids=args.instance_ids,
        pattern=args.filter,
        shuffle=args.shuffle,
        seed=args.seed,
        slice_spec=args.slice,
    )
    out = OutputDir(args.output)
    finished = out.finished(retry_errors=args.retry_errors)
    todo = [i for i in chosen if i.instance_id not in finished]
    print(
        f"{len(chosen)} instances selected, {len(chosen) - len(todo)} already done in "
        f"{args.output}, {len(todo)} to run",
        flush=True,
    )

    tasks: list[Any] = []
    scripted = args.replay or args.script
    if args.dataset.is_dir() and (scripted or not args.no_build) and not args.agent:
        from swerl.tasks import build_images, load_tasks

        wanted = {i.instance_id for i in todo}
        tasks = [t for t in load_tasks(args.dataset) if t.instance_id in wanted]
        if not args.no_build and not args.pool:
            await asyncio.to_thread(
                build_images, tasks, base_image=args.base_image, progress=lambda line: None
            )
    tokenizer = args.tokenizer
    if not tokenizer and (args.replay or args.policy_api in ("sglang", "vllm")):
        from swerl.chassis.hf import bundled_qwen3_tokenizer_dir

        tokenizer = str(bundled_qwen3_tokenizer_dir())
    # vLLM takes the model as the served name it samples from: none named, its one model.
    default_model = "" if args.policy_api == "vllm" else args.policy_url
    model = args.model or ("replay" if args.replay else default_model)
    config = EvalConfig(
        policy_endpoint="",
        policy_api=args.policy_api,
        model=model,
        tokenizer_path=tokenizer or "",
        sampling_params=args.sampling_params,
        max_turns=args.max_turns,
        max_context_tokens=args.max_context_tokens,
        max_new_tokens=args.max_new_tokens,
        wall_timeout_s=args.wall_timeout,
        command_timeout_s=args.command_timeout,
        eval_timeout_s=args.eval_timeout,
        concurrency=args.concurrency,
        artifact_dir=args.remote_artifact_dir if args.agent else str(out.artifacts.resolve()),
        config_name=args.config_name,
        harness=args.harness,
        branch_at=args.branch_at or 0,
        branches=args.branches or 0,
    )
    info: dict[str, Any] = {"dataset": str(args.dataset), "policy_api": args.policy_api}
    if config.branches:
        info.update(branch_at=config.branch_at)
    progress = Progress(len(todo))
    if todo:
        async with _policy(args, tasks) as url, _agent(args) as (address, token):
            config.policy_endpoint = url
            info["policy_endpoint"] = url
            channel = make_channel(
                address,
                token=token,
                extra_options=(("grpc.max_receive_message_length", _MAX_MESSAGE),),
            )
            try:
                from swerl.agent.v1 import agent_pb2_grpc

                stub = agent_pb2_grpc.AgentServiceStub(channel)
                progress.show()
                await run_all(stub, todo, out, config, progress)
            finally:
                progress.close()
                await channel.close()
    summary = out.write_derived([i.instance_id for i in chosen], model, info)
    print(
        f"resolved {summary['resolved']}/{summary['instances']} "
        f"({100 * summary['resolve_rate']:.1f}%), errors {summary['errors']}, "
        f"not run {summary['not_run']}; by status {json.dumps(summary['by_status'])}"
    )
    if "pass_at_n" in summary:
        print(
            f"pass@{summary['branches']} {summary['resolved']}/{summary['instances']} "
            f"({100 * summary['pass_at_n']:.1f}%), pass@1 estimate "
            f"{100 * summary['pass_at_1']:.1f}% (branches from turn {config.branch_at})"
        )
    print(f"wrote {args.output}/results.jsonl, preds.jsonl, summary.json")
    if summary["errors"]:
        print("errors are not scored; run again with --retry-errors to retry them")
    return 0 if not summary["errors"] and not summary["not_run"] else 1


def _eval(args: argparse.Namespace) -> int:
    configure_logging("console", "warning")
    if not args.replay and not args.policy_url:
        print("swerl eval: give --policy-url (or --replay for the demo policy)", file=sys.stderr)
        return 2
    if not args.dataset.exists():
        print(f"swerl eval: {args.dataset}: no such file or directory", file=sys.stderr)
        return 2
    if args.replay and not args.dataset.is_dir():
        print("swerl eval: --replay plays scripts of a tasks directory", file=sys.stderr)
        return 2
    problem = _script_problem(args) or _branching_problem(args) or _harness_problem(args)
    if problem:
        print(f"swerl eval: {problem}", file=sys.stderr)
        return 2

    async def main() -> int:
        # SIGINT/SIGTERM cancel the run: running episodes are cancelled (their sandboxes are
        # released), finished ones are already on disk, and the next run resumes.
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        assert task is not None

        def interrupt() -> None:
            # A second Ctrl-C ends the process at once; a shutdown still running after
            # EXIT_STACKS_AFTER_S writes every task's and thread's stack (what it waits on).
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_DFL)
            loop.call_later(EXIT_STACKS_AFTER_S, _write_task_stacks)
            faulthandler.dump_traceback_later(EXIT_STACKS_AFTER_S)
            task.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, interrupt)
        try:
            return await _run(args)
        except asyncio.CancelledError:
            # Episodes are cancelled and their sandboxes released by now.
            print("\ninterrupted; run the same command again to resume", file=sys.stderr)
            return 130

    try:
        return asyncio.run(main())
    except ValueError as exc:
        print(f"swerl eval: {exc}", file=sys.stderr)
        return 2
    finally:
        faulthandler.cancel_dump_traceback_later()


# After an interruption, how long the shutdown may take before every stack is written.
EXIT_STACKS_AFTER_S = 30.0


def _write_task_stacks() -> None:
    print(
        f"swerl eval: still stopping {EXIT_STACKS_AFTER_S:.0f} s after the interruption; "
        "its tasks wait here:",
        file=sys.stderr,
    )
    for pending in asyncio.all_tasks():
        pending.print_stack(limit=30, file=sys.stderr)


MAX_BRANCHES = 64  # EpisodeBranch.count's limit in the agent contract


def _harness_problem(args: argparse.Namespace) -> str | None:
    """Why this process's agent cannot run --harness (None: it can, or the agent is remote and
    answers for its own host). Checked before anything starts: no stack, no sandbox leased."""
    if args.agent:
        return None
    from swerl.agent.errors import HarnessUnavailable
    from swerl.agent.harnesses import check_installed

    try:
        check_installed(args.harness)
    except HarnessUnavailable as err:
        return err.message
    return None


def _branching_problem(args: argparse.Namespace) -> str | None:
    """Why --branch-at/--branches cannot describe a best-of-n run (None: they can)."""
    at, count = args.branch_at, args.branches
    if at is None and count is None:
        return None
    if (at is not None and at < 0) or (count is not None and count < 0):
        return "--branch-at and --branches take numbers >= 0"
    if count is None:
        return "--branch-at needs --branches N (N >= 2 branches from the shared start)"
    if at is None:
        return "--branches needs --branch-at K (the turns of the shared start)"
    if not 2 <= count <= MAX_BRANCHES:
        return f"--branches takes 2 to {MAX_BRANCHES} branches, not {count}"
    if args.max_turns and at >= args.max_turns:
        return f"--branch-at {at} must be below --max-turns {args.max_turns}"
    if args.policy_api not in ("sglang", "vllm"):
        return "--branch-at/--branches need --policy-api sglang or vllm (token-exact forks)"
    return None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="evaluate a policy on a SWE dataset through the agent, pool and exec nodes",
        description=(
            "Runs one agent episode per instance and grades its patch. Writes OUTPUT/results.jsonl"
            " (one record per instance, as episodes end), preds.jsonl (SWE-bench predictions),"
            " summary.json, and per-episode artifacts under OUTPUT/artifacts. Instances already"
            " in results.jsonl are skipped, so an interrupted run resumes. Errors (infra"
            " failures) are counted apart and re-run with --retry-errors. By default everything"
            " runs in this process on the local dockerd; --agent or --pool use running services."
        ),
    )
    parser.add_argument(
        "dataset",
        type=Path,
        help="tasks directory, slime JSONL from `swerl data prepare`, or raw rows (jsonl/parquet)",
    )
    parser.add_argument("--output", "-o", type=Path, required=True, help="output directory")
    policy = parser.add_argument_group("policy")
    policy.add_argument("--policy-url", help="policy server base URL (SGLang router or OpenAI)")
    policy.add_argument("--policy-api", choices=["sglang", "vllm", "openai"], default="sglang")
    policy.add_argument(
        "--model", default="", help="model name (OpenAI, vLLM's served name) and in preds.jsonl"
    )
    policy.add_argument(
        "--tokenizer", help="local tokenizer directory (SGLang, vLLM; default Qwen3)"
    )
    policy.add_argument(
        "--sampling-params",
        type=json.loads,
        default={},
        help="SGLang sampling params as JSON, e.g. '{\"temperature\": 0.0}'",
    )
    policy.add_argument(
        "--replay",
        choices=["gold", "wrong", "garbage"],
        help="run the in-process replay policy on a tasks directory (demo, tests)",
    )
    policy.add_argument("--replay-latency", type=float, default=0.0, help=argparse.SUPPRESS)
    policy.add_argument(
        "--script",
        choices=["gold", "wrong"],
        help="force the real engine (--policy-api vllm) through each task's replay script:"
        " every turn's text is the request's constraint, the engine samples it",
    )
    policy.add_argument(
        "--forcing",
        choices=["text", "tokens"],
        default="text",
        help="with --script: force the turn's text (default; the engine picks the tokens) or its"
        " canonical token ids",
    )
    services = parser.add_argument_group("services (default: all in this process)")
    services.add_argument("--agent", help="a running AgentService host:port")
    services.add_argument("--pool", help="a running PoolService host:port (agent in-process)")
    services.add_argument(
        "--token",
        default=os.environ.get("SWERL_TOKEN"),
        help="bearer token of --agent/--pool (default: $SWERL_TOKEN)",
    )
    services.add_argument("--nodes", type=int, default=1, help="in-process exec nodes")
    services.add_argument(
        "--gateway-port",
        type=int,
        default=0,
        help="model gateway port of the in-process agent (default: a free port)",
    )
    services.add_argument("--stack-name", help=argparse.SUPPRESS)
    services.add_argument(
        "--remote-artifact-dir", default="", help="artifact_dir on a remote agent's host"
    )
    services.add_argument(
        "--base-image",
        default=os.environ.get("SWERL_BASE_IMAGE", "swerl-base:bookworm"),
        help="base image for a tasks directory's images",
    )
    services.add_argument("--no-build", action="store_true", help="do not build task images")
    pick = parser.add_argument_group("instances")
    pick.add_argument("--instance-ids", nargs="+", help="only these instance ids")
    pick.add_argument("--filter", help="only instance ids matching this regular expression")
    pick.add_argument("--shuffle", action="store_true", help="shuffle before slicing")
    pick.add_argument("--seed", type=int, default=0, help="shuffle seed")
    pick.add_argument("--slice", help="START:STOP of the (shuffled) list, e.g. 0:50")
    pick.add_argument("--image-convention", choices=CONVENTIONS, default="auto")
    pick.add_argument("--registry-prefix", default="", help="see `swerl data prepare`")
    run = parser.add_argument_group("run")
    run.add_argument("--concurrency", "-j", type=int, default=4, help="episodes at once")
    run.add_argument("--retry-errors", action="store_true", help="re-run INFRA_ERROR/ABORTED")
    run.add_argument("--config-name", default="", help="agent config (default: 'default')")
    run.add_argument(
        "--harness", default="", help="who drives each episode (default: builtin, swerl's loop)"
    )
    run.add_argument("--max-turns", type=int, default=0, help="0: the agent config's")
    run.add_argument("--max-context-tokens", type=int, default=0)
    run.add_argument("--max-new-tokens", type=int, default=0)
    run.add_argument("--wall-timeout", type=float, default=0.0, help="seconds per episode")
    run.add_argument("--command-timeout", type=float, default=0.0, help="seconds per command")
    run.add_argument("--eval-timeout", type=float, default=0.0, help="seconds per evaluation")
    best = parser.add_argument_group(
        "best-of-n from a shared start",
        "each instance runs K turns once, then N branches with distinct sampling seeds from "
        "the same sandbox and token state, each graded; results.jsonl gets one line per branch "
        "(branch, sampling_seed); the summary reports pass@N (any branch resolved) and the "
        "pass@1 estimate (mean over the branches)",
    )
    best.add_argument("--branch-at", type=int, metavar="K", help="turns of the shared trunk")
    best.add_argument("--branches", type=int, metavar="N", help="branches (2 to 64)")
    parser.set_defaults(handler=_eval)
