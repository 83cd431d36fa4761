"""`swerl agent serve` (the agent service)."""

from __future__ import annotations

import argparse

from swerl.chassis.server import serve_main
from swerl.chassis.settings import add_settings_arguments


def _serve(args: argparse.Namespace) -> int:
    from swerl.agent.server import AgentServer
    from swerl.agent.settings import AgentSettings

    built: list[AgentServer] = []

    def build(settings: AgentSettings) -> AgentServer:
        built.append(AgentServer(settings))
        return built[-1]

    def banner(settings: AgentSettings, port: int) -> str:
        line = f"swerl agent serving on {settings.host}:{port}"
        gateway = built[-1].gateway
        # One line (launchers wait for it): the model gateway's URL when --gateway-port is set.
        return line if gateway is None else f"{line}; model gateway on {gateway.url}"

    # AgentServer judges PRM-enabled episodes through PrmService itself (PrmJudgeFactory with
    # --prm-endpoint and --prm-auth-token, default the agent's own token).
    return serve_main(AgentSettings, args, build, banner)


def register(subparsers: argparse._SubParsersAction) -> None:
    from swerl.agent.settings import AgentSettings

    parser = subparsers.add_parser("agent", help="the agent service (episodes)")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve AgentService")
    add_settings_arguments(serve, AgentSettings)
    serve.set_defaults(handler=_serve)
