"""`swerl exec serve` (the exec node of a Docker host)."""

from __future__ import annotations

import argparse

from swerl.chassis.server import serve_main
from swerl.chassis.settings import add_settings_arguments


def _serve(args: argparse.Namespace) -> int:
    from swerl.exec.server import ExecNode
    from swerl.exec.settings import ExecSettings

    return serve_main(
        ExecSettings,
        args,
        ExecNode,
        lambda settings, port: (
            f"swerl exec node {settings.node_id} serving on {settings.host}:{port}"
        ),
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    from swerl.exec.settings import ExecSettings

    parser = subparsers.add_parser("exec", help="the exec node of a Docker host")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve SandboxService on the local dockerd")
    add_settings_arguments(serve, ExecSettings)
    serve.set_defaults(handler=_serve)
