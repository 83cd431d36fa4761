"""`swerl prm serve` (the PRM judge service).

`swerl prm scripted-judge`, a stand-in judge model for demos, is a tool: `swerl.cli` adds it to the
subcommands `register` returns, so this service never imports the tool layer."""

from __future__ import annotations

import argparse

from swerl.chassis.server import serve_main
from swerl.chassis.settings import add_settings_arguments


def _serve(args: argparse.Namespace) -> int:
    from swerl.prm.server import PrmServer
    from swerl.prm.settings import PrmSettings

    return serve_main(
        PrmSettings,
        args,
        PrmServer,
        lambda settings, port: (
            f"swerl prm serving on {settings.host}:{port} (judge {settings.backend}"
            f" at {settings.judge_url})"
        ),
    )


def register(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:
    from swerl.prm.settings import PrmSettings

    prm = subparsers.add_parser("prm", help="the PRM judge service")
    commands = prm.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve PrmService over a judge model")
    add_settings_arguments(serve, PrmSettings)
    serve.set_defaults(handler=_serve)
    return commands
