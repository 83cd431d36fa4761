"""`swerl agent serve` (the agent service)."""

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
        await server.serve_until_signal()

    asyncio.run(main())
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from swerl.agent.settings import AgentSettings

    parser = subparsers.add_parser("agent", help="the agent service (episodes)")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve AgentService")
    add_settings_arguments(serve, AgentSettings)
    serve.set_defaults(handler=_serve)
