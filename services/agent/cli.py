"""`swerl agent serve` (the agent service) and `swerl replay serve` (the replay policy server)."""

from __future__ import annotations

import argparse
import asyncio

from swerl.chassis.logging import configure_logging
from swerl.chassis.settings import add_settings_arguments, settings_from_args


def _serve(args: argparse.Namespace) -> int:
    from swerl.agent.server import AgentServer
    from swerl.agent.settings import AgentSettings

    settings = settings_from_args(AgentSettings, args)
    configure_logging(settings.log_format, settings.log_level)

    async def main() -> None:
        # AgentServer judges PRM-enabled episodes through PrmService itself (PrmJudgeFactory
        # with --prm-endpoint and --prm-auth-token, default the agent's own token).
        server = AgentServer(settings)
        port = await server.start()
        print(f"swerl agent serving on {settings.host}:{port}", flush=True)
        if server.gateway is not None:
            print(f"swerl agent model gateway on {server.gateway.url}", flush=True)
        await server.serve_until_signal()

    asyncio.run(main())
    return 0


def _replay(args: argparse.Namespace) -> int:
    from pathlib import Path

    from swerl.agent.replay import ReplayPolicyServer, scripts_for_tasks
    from swerl.tasks import default_tasks_dir, load_tasks

    tasks = load_tasks(Path(args.tasks) if args.tasks else default_tasks_dir())
    scripts = {} if args.garbage else scripts_for_tasks(tasks, args.variant)

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


def register(subparsers: argparse._SubParsersAction) -> None:
    from swerl.agent.settings import AgentSettings

    parser = subparsers.add_parser("agent", help="the agent service (episodes)")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve AgentService")
    add_settings_arguments(serve, AgentSettings)
    serve.set_defaults(handler=_serve)

    replay = subparsers.add_parser("replay", help="replay policy server (SGLang /generate)")
    replay_commands = replay.add_subparsers(dest="command", required=True)
    rs = replay_commands.add_parser("serve", help="serve scripted turns for a task set")
    rs.add_argument("--host", default="127.0.0.1")
    rs.add_argument("--port", type=int, default=30000)
    rs.add_argument("--tasks", help="tasks directory (default: the bundled examples)")
    rs.add_argument("--variant", choices=["gold", "wrong", "destructive"], default="gold")
    rs.add_argument("--garbage", action="store_true", help="answer random tokens")
    rs.add_argument("--latency-s", type=float, default=0.0)
    rs.add_argument("--tokenizer", help="tokenizer directory (default: bundled Qwen3)")
    rs.add_argument(
        "--fault-control",
        action="store_true",
        help="serve POST /fault {mode: error|hang|none, duration_s} to inject policy faults",
    )
    rs.set_defaults(handler=_replay)
