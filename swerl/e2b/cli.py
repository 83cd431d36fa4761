"""`swerl e2b serve`: an E2B-compatible face on the pool (see swerl.e2b and docs/e2b.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from swerl.chassis.logging import configure_logging
from swerl.chassis.settings import add_settings_arguments, settings_from_args


def _serve(args: argparse.Namespace) -> int:
    from swerl.e2b.server import serve_until_cancelled
    from swerl.e2b.settings import E2BSettings

    settings = settings_from_args(E2BSettings, args)
    configure_logging(settings.log_format, settings.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_until_cancelled(settings))
    return 0


def register(services: argparse._SubParsersAction) -> None:
    from swerl.e2b.settings import E2BSettings

    parser = services.add_parser("e2b", help="an E2B-compatible face on the pool")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="serve E2B's control API and sandbox API (envd) in front of the pool"
    )
    add_settings_arguments(serve, E2BSettings)
    serve.add_argument(
        "--api-port", dest="port", default=argparse.SUPPRESS, help="the same as --port"
    )
    serve.set_defaults(handler=_serve)
