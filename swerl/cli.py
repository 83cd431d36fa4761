"""The `swerl` command: one subcommand per service and tool (`swerl exec serve`, ...)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError

from swerl.chassis.errors import StartupRefused
from swerl.chassis.logging import configure_logging, quiet_foreign_libraries
from swerl.tasks import TaskFormatError, TaskImageError, TaskInstance


def _demo(args: argparse.Namespace) -> int:
    from swerl.demo import run_demo

    configure_logging("console", "warning")
    if args.policy_url and args.engine != "vllm":
        print("swerl demo: --policy-url is the engine of --engine vllm", file=sys.stderr)
        return 2
    return asyncio.run(run_demo(args.image, args.engine, args.policy_url or ""))


def _load_tasks(args: argparse.Namespace) -> tuple[Path, list[TaskInstance]]:
    """The positional tasks directory or rows file, else the --tasks directory (default: the
    bundled set), and its tasks."""
    from swerl.tasks import default_tasks_dir, load_task_source, load_tasks

    if args.source is not None and args.tasks is not None:
        raise TaskFormatError(f"give either {args.source} or --tasks {args.tasks}, not both")
    if args.source is None:
        directory = args.tasks or default_tasks_dir()
        return directory, load_tasks(directory)
    tasks = load_task_source(
        args.source, convention=args.image_convention, registry_prefix=args.registry_prefix
    )
    return args.source, tasks


def _tasks_build(args: argparse.Namespace) -> int:
    from swerl.tasks import build_images

    _, tasks = _load_tasks(args)
    build_images(tasks, base_image=args.base_image, rebuild=args.rebuild)
    return 0


def _validate(args: argparse.Namespace) -> int:
    from swerl.validate import render, run_local, run_remote

    configure_logging("console", "warning")
    source, tasks = _load_tasks(args)
    if args.only:
        tasks = [t for t in tasks if t.instance_id in set(args.only)]
    print(f"validating {len(tasks)} tasks from {source}", flush=True)

    if args.node:
        checks = asyncio.run(
            run_remote(
                tasks,
                node=args.node,
                token=args.token,
                concurrency=args.concurrency,
                timeout_s=args.timeout,
            )
        )
    else:
        checks = asyncio.run(
            run_local(
                tasks,
                base_image=args.base_image,
                build=not args.no_build,
                concurrency=args.concurrency,
                timeout_s=args.timeout,
            )
        )
    print(render(checks))
    return 0 if all(check.ok for check in checks) else 1


def _replay_serve(args: argparse.Namespace) -> int:
    from swerl.devservers.replay import HARNESS_SCRIPTS, ReplayPolicyServer, scripts_for_tasks
    from swerl.tasks import default_tasks_dir, load_tasks

    if args.harness and args.harness not in HARNESS_SCRIPTS:
        known = ", ".join(sorted(HARNESS_SCRIPTS))
        print(
            f"swerl replay serve: --harness {args.harness!r} is not one of {known}",
            file=sys.stderr,
        )
        return 2
    tasks = load_tasks(Path(args.tasks) if args.tasks else default_tasks_dir())
    scripts = (
        {}
        if args.garbage
        else scripts_for_tasks(
            tasks, args.variant, tool_call_parser=args.tool_call_parser, harness=args.harness
        )
    )

    async def main() -> None:
        server = ReplayPolicyServer(
            scripts,
            tokenizer_dir=args.tokenizer,
            garbage=args.garbage,
            latency_s=args.latency_s,
            host=args.host,
            port=args.port,
            fault_control=args.fault_control,
        )
        url = await server.start()
        print(f"swerl replay policy serving /generate on {url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await server.stop()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    return 0


def _scripted_judge(args: argparse.Namespace) -> int:
    from swerl.chassis.hf import bundled_qwen3_tokenizer_dir
    from swerl.devservers.scripted_prm import Reply, ScriptedJudge

    configure_logging("console", "warning")
    replies = [Reply(text=text.replace("\\n", "\n"), delay_s=args.delay_s) for text in args.reply]
    judge = ScriptedJudge(
        args.tokenizer_path or bundled_qwen3_tokenizer_dir(), default=replies, host=args.host
    )

    async def main() -> None:
        # The handlers go in before the server says it serves: a signal sent the moment it
        # does must find them.
        with _stop_signals() as stop:
            await judge.start(args.port)
            print(f"scripted judge serving /generate on {judge.url}", flush=True)
            try:
                await stop.wait()
            finally:
                await judge.stop()

    asyncio.run(main())
    return 0


@contextlib.contextmanager
def _stop_signals() -> Iterator[asyncio.Event]:
    """An event set on the first SIGINT or SIGTERM while the block runs.

    The loop's own handlers, not Python's KeyboardInterrupt: a process started with SIGINT
    ignored (any background job of a non-interactive shell, so a test runner's or a script's
    children) inherits SIG_IGN, Python then installs no SIGINT handler and asyncio.run() none
    either, and the server never stopped on Ctrl-C or a supervisor's SIGINT. SIGTERM (what
    systemd and docker send) stops it the same way.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    try:
        yield stop
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


def _add_scripted_judge(prm_commands: argparse._SubParsersAction) -> None:
    """`swerl prm scripted-judge`: a scripted judge model server speaking SGLang's /generate, for
    demos and local runs without a GPU. A tool beside the PRM service's own `serve`."""
    scripted = prm_commands.add_parser(
        "scripted-judge", help="a scripted judge model server (SGLang /generate) for demos"
    )
    scripted.add_argument("--host", default="127.0.0.1", help="interface to bind")
    scripted.add_argument("--port", type=int, default=30000, help="HTTP port")
    scripted.add_argument(
        "--tokenizer-path", type=Path, help="judge tokenizer to decode prompts (default: Qwen3)"
    )
    scripted.add_argument(
        "--reply",
        nargs="+",
        default=["The step helps.\\n\\boxed{+1}"],
        help="answers played in order, the last repeating",
    )
    scripted.add_argument(
        "--delay-s", type=float, default=0.0, help="seconds each answer takes (model latency)"
    )
    scripted.set_defaults(handler=_scripted_judge)


# Packages that add subcommands through a `register(subparsers)` function in their `cli` module.
_REGISTERED: tuple[str, ...] = (
    "pool",
    "data",
    "images",
    "prm",
    "agent",
    "evaluation",
    "web",
    "e2b",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swerl", description=__doc__)
    services = parser.add_subparsers(dest="service", required=True)

    # Each service and tool owns its subcommands in `swerl.<name>.cli.register`; the exec node
    # first, the task-set tools below are this module's own.
    importlib.import_module("swerl.exec.cli").register(services)

    from swerl.data.naming import CONVENTIONS

    source_help = (
        "a tasks directory, or a file of SWE-bench / SWE-Gym rows as published (parquet, JSON,"
        " JSON lines), whose images are named as published and never built (default: --tasks)"
    )
    tasks_help = "tasks directory (default: the bundled examples/tasks or $SWERL_TASKS_DIR)"
    convention_help = "image naming rule of rows without image_name (see `swerl data prepare`)"
    base_image = os.environ.get("SWERL_BASE_IMAGE", "swerl-base:bookworm")
    tasks_parser = services.add_parser("tasks", help="SWE-bench-format task sets")
    tasks_cmds = tasks_parser.add_subparsers(dest="command", required=True)
    build = tasks_cmds.add_parser("build", help="build the task images on the local dockerd")
    build.add_argument("source", type=Path, nargs="?", help=source_help)
    build.add_argument("--tasks", type=Path, help=tasks_help)
    build.add_argument(
        "--image-convention", choices=CONVENTIONS, default="auto", help=convention_help
    )
    build.add_argument("--registry-prefix", default="", help="see `swerl data prepare`")
    build.add_argument("--base-image", default=base_image, help="image the Dockerfiles start FROM")
    build.add_argument("--rebuild", action="store_true", help="rebuild images already present")
    build.set_defaults(handler=_tasks_build)

    validate = services.add_parser(
        "validate", help="check that gold patches resolve and empty/wrong ones do not"
    )
    validate.add_argument("source", type=Path, nargs="?", help=source_help)
    validate.add_argument("--tasks", type=Path, help=tasks_help)
    validate.add_argument(
        "--image-convention", choices=CONVENTIONS, default="auto", help=convention_help
    )
    validate.add_argument("--registry-prefix", default="", help="see `swerl data prepare`")
    validate.add_argument("--only", nargs="*", help="instance ids to validate (default: all)")
    validate.add_argument("--node", help="exec node address (default: an in-process node)")
    validate.add_argument("--token", help="bearer token of --node")
    validate.add_argument("--base-image", default=base_image, help="base image for task images")
    validate.add_argument("--no-build", action="store_true", help="do not build task images")
    validate.add_argument("--concurrency", type=int, default=2, help="evaluations at once")
    from swerl.exec.settings import DEFAULT_EVALUATION_TIMEOUT_S

    validate.add_argument(
        "--timeout", type=float, default=DEFAULT_EVALUATION_TIMEOUT_S, help="test timeout, seconds"
    )
    validate.set_defaults(handler=_validate)

    demo = services.add_parser("demo", help="a local tour on the embedded defaults")
    from swerl.demo import DEFAULT_IMAGE

    demo.add_argument("--image", default=DEFAULT_IMAGE, help="image of the demo sandbox")
    demo.add_argument(
        "--engine",
        choices=["replay", "vllm"],
        default="replay",
        help="the episodes' policy: the embedded replay (default) or a real vLLM engine",
    )
    demo.add_argument(
        "--policy-url",
        help="with --engine vllm: a running engine (default: start one with scripts/vllm-serve)",
    )
    demo.set_defaults(handler=_demo)

    # The replay policy server plays scripted turns for a task set (a tool over task sets).
    replay = services.add_parser("replay", help="replay policy server (SGLang /generate)")
    replay_commands = replay.add_subparsers(dest="command", required=True)
    rs = replay_commands.add_parser("serve", help="serve scripted turns for a task set")
    rs.add_argument("--host", default="127.0.0.1")
    rs.add_argument("--port", type=int, default=30000)
    rs.add_argument("--tasks", help="tasks directory (default: the bundled examples)")
    rs.add_argument("--variant", choices=["gold", "wrong", "destructive"], default="gold")
    rs.add_argument("--garbage", action="store_true", help="answer random tokens")
    rs.add_argument(
        "--tool-call-parser",
        default="",
        help="gold and wrong act through tool calls in this parser's format (e.g. qwen25), for"
        " episodes of the `tool_calls` protocol (agent config `tools`)",
    )
    rs.add_argument(
        "--harness",
        default="",
        help="gold and wrong act through this harness's own tools (EpisodeOptions.harness):"
        " mini-swe-agent or claude-code",
    )
    rs.add_argument("--latency-s", type=float, default=0.0)
    rs.add_argument("--tokenizer", help="tokenizer directory (default: bundled Qwen3)")
    rs.add_argument(
        "--fault-control",
        action="store_true",
        help="serve POST /fault {mode: error|hang|none, duration_s} to inject policy faults",
    )
    rs.set_defaults(handler=_replay_serve)

    # Each further service and tool owns its subcommands in `swerl.<name>.cli.register`.
    for name in _REGISTERED:
        commands = importlib.import_module(f"swerl.{name}.cli").register(services)
        if name == "prm":
            _add_scripted_judge(commands)
    return parser


def settings_error_lines(exc: ValidationError) -> list[str]:
    """One human line per problem of invalid settings: a bad field names the field; a problem of
    the settings as a whole (a model validator's ValueError, one problem per line) is its own
    sentence; neither carries pydantic's "Value error," or the settings class's name."""
    lines = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"])
        message = error["msg"]
        if error["type"] == "value_error":
            message = str(error.get("ctx", {}).get("error", message))
        for problem in message.splitlines():
            lines.append(f"swerl: invalid setting{' ' + where if where else ''}: {problem}")
    return lines


def main(argv: list[str] | None = None) -> int:
    # Before anything imports grpc or transformers (building the parser imports the services).
    quiet_foreign_libraries()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except ValidationError as exc:
        # One line per problem, without pydantic's documentation links.
        for line in settings_error_lines(exc):
            print(line, file=sys.stderr)
        return 2
    except StartupRefused as exc:
        # A service whose settings name what this host lacks: what to do, in one line.
        print(f"swerl: {exc}", file=sys.stderr)
        return 2
    except (TaskFormatError, TaskImageError) as exc:
        # A bad task row or image is the user's input: one message, no traceback.
        print(f"swerl: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
