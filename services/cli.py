"""The `swerl` command: one subcommand per service and tool (`swerl exec serve`, ...)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pydantic import ValidationError

from swerl.chassis.logging import configure_logging
from swerl.chassis.settings import add_settings_arguments, settings_from_args


def _exec_serve(args: argparse.Namespace) -> int:
    from swerl.exec.server import ExecNode
    from swerl.exec.settings import ExecSettings

    settings = settings_from_args(ExecSettings, args)
    configure_logging(settings.log_format, settings.log_level)

    async def main() -> None:
        node = ExecNode(settings)
        port = await node.start()
        print(f"swerl exec node {settings.node_id} serving on {settings.host}:{port}", flush=True)
        await node.serve_until_signal()

    asyncio.run(main())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from swerl.demo import run_demo

    configure_logging("console", "warning")
    return asyncio.run(run_demo(args.image))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swerl", description=__doc__)
    services = parser.add_subparsers(dest="service", required=True)

    exec_parser = services.add_parser("exec", help="the exec node of a Docker host")
    exec_cmds = exec_parser.add_subparsers(dest="command", required=True)
    from swerl.exec.settings import ExecSettings

    serve = exec_cmds.add_parser("serve", help="serve SandboxService on the local dockerd")
    add_settings_arguments(serve, ExecSettings)
    serve.set_defaults(handler=_exec_serve)

    demo = services.add_parser("demo", help="a local tour on the embedded defaults")
    from swerl.demo import DEFAULT_IMAGE

    demo.add_argument("--image", default=DEFAULT_IMAGE, help="image of the demo sandbox")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except ValidationError as exc:
        print(f"swerl: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
