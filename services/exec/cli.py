"""`swerl exec serve` (the exec node of a Docker host) and `swerl exec bundle` (its harness
bundles, built ahead of the first harness episode)."""

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


def _bundle(args: argparse.Namespace) -> int:
    # The node's own settings without the server's (no auth token needed to build files).
    import os
    import sys
    from pathlib import Path

    from swerl.chassis.errors import SwerlError
    from swerl.exec.bundles import HarnessBundles, harness_package

    state = Path(os.environ.get("SWERL_EXEC_STATE_DIR", "/var/lib/swerl/exec"))
    root = Path(args.dir or os.environ.get("SWERL_EXEC_HARNESS_BUNDLE_DIR") or state / "bundles")
    index = os.environ.get("SWERL_EXEC_HARNESS_PACKAGE_INDEX", "")
    try:
        package, version = harness_package(args.harness, args.version)
        bundle = HarnessBundles(root, package_index=index).build_blocking(package, version)
    except SwerlError as err:  # an unknown harness or version, a build that failed
        print(f"swerl exec bundle: {err}", file=sys.stderr)
        return 2
    print(f"{bundle.harness} {bundle.version}: {bundle.host_dir}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from swerl.exec.settings import ExecSettings

    parser = subparsers.add_parser("exec", help="the exec node of a Docker host")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve SandboxService on the local dockerd")
    add_settings_arguments(serve, ExecSettings)
    serve.set_defaults(handler=_serve)
    bundle = commands.add_parser(
        "bundle", help="build a harness bundle (Node runtime + CLI harness) for this node"
    )
    bundle.add_argument("--harness", default="claude-code", help="harness to bundle")
    bundle.add_argument("--version", default="", help="its package version (default: pinned)")
    bundle.add_argument(
        "--dir",
        default="",
        help="bundle directory (default: SWERL_EXEC_HARNESS_BUNDLE_DIR, else"
        " $SWERL_EXEC_STATE_DIR/bundles, as the node)",
    )
    bundle.set_defaults(handler=_bundle)
