"""`swerl pool serve` (the pool server) and `swerl pool leases|nodes|prewarm|drain` (operators)."""

from __future__ import annotations

import argparse
import asyncio
import json

from swerl.chassis.server import serve_main
from swerl.chassis.settings import add_settings_arguments


def _serve(args: argparse.Namespace) -> int:
    from swerl.pool.server import PoolServer, tune_garbage_collector
    from swerl.pool.settings import PoolSettings

    return serve_main(
        PoolSettings,
        args,
        PoolServer,
        lambda settings, port: f"swerl pool serving on {settings.host}:{port}",
        started=tune_garbage_collector,
    )


def _operator(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from swerl.pool.client import PoolClient

    async def main() -> object:
        pool = PoolClient(args.pool, token=args.token)
        try:
            if args.command == "leases":
                return [MessageToDict(x) for x in await pool.list_leases()]
            if args.command == "nodes":
                return [MessageToDict(x) for x in await pool.list_nodes()]
            if args.command == "prewarm":
                return MessageToDict(await pool.prewarm(args.image, args.count))
            return MessageToDict(await pool.drain_node(args.node_id, evict=args.evict))
        finally:
            await pool.close()

    print(json.dumps(asyncio.run(main()), indent=2))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from swerl.pool.settings import PoolSettings

    parser = subparsers.add_parser("pool", help="the pool of sandbox leases (head node)")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve PoolService")
    add_settings_arguments(serve, PoolSettings)
    serve.set_defaults(handler=_serve)

    def operator(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--pool", default="127.0.0.1:18090", help="pool address")
        sub.add_argument("--token", help="bearer token of the pool")
        sub.set_defaults(handler=_operator)
        return sub

    operator("leases", "list leases")
    operator("nodes", "list exec nodes")
    prewarm = operator("prewarm", "keep COUNT warm spares of IMAGE")
    prewarm.add_argument("image")
    prewarm.add_argument("count", type=int)
    drain = operator("drain", "take a node out of scheduling")
    drain.add_argument("node_id")
    drain.add_argument("--evict", action="store_true", help="revoke its leases now")
