"""`swerl inspect PATH` and `swerl dashboard --pool ADDR`: serve the browser views and print the
URL (nothing is opened by itself). Both bind 127.0.0.1 unless --host says otherwise."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from aiohttp import web


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range 0-65535: {port}")
    return port


async def _serve(app: web.Application, host: str, port: int, what: str) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise SystemExit(f"swerl {what}: cannot listen on {host}:{port}: {exc.strerror}") from None
    bound = runner.addresses[0][1]
    shown = f"[{host}]" if ":" in host else host
    print(f"swerl {what}: http://{shown}:{bound}/", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def _inspect(args: argparse.Namespace) -> int:
    from swerl.web.inspect_app import make_app, tokenizer_decoder
    from swerl.web.runs import Run, RunNotFound

    started = time.perf_counter()
    try:
        run = Run.open(args.path)
    except RunNotFound as exc:
        print(f"swerl inspect: {exc}", file=sys.stderr)
        return 2
    print(
        f"swerl inspect: {len(run.index)} episodes indexed in "
        f"{time.perf_counter() - started:.2f} s",
        flush=True,
    )
    tokenizer = args.tokenizer
    if tokenizer is None:
        try:
            from swerl.chassis.hf import bundled_qwen3_tokenizer_dir

            tokenizer = str(bundled_qwen3_tokenizer_dir())
        except Exception:  # no bundled tokenizer installed: the token view shows ids
            tokenizer = ""
    decode = tokenizer_decoder(tokenizer)
    asyncio.run(_serve(make_app(run, decode), args.host, args.port, "inspect"))
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from swerl.web.dashboard import DashboardConfig, make_app

    token = args.token if args.token is not None else os.environ.get("SWERL_TOKEN", "")
    config = DashboardConfig(
        pool=args.pool, agents=list(args.agent or []), token=token, interval_s=args.interval
    )

    async def main() -> None:
        await _serve(make_app(config), args.host, args.port, "dashboard")

    asyncio.run(main())
    return 0


def register(services: argparse._SubParsersAction) -> None:
    inspect = services.add_parser(
        "inspect", help="browse the trajectories of an eval run or an agent artifact directory"
    )
    inspect.add_argument("path", type=Path, help="eval output directory or agent artifact_dir")
    inspect.add_argument("--host", default="127.0.0.1", help="address to bind")
    inspect.add_argument("--port", type=_port, default=8321, help="port (0: any free one)")
    inspect.add_argument(
        "--tokenizer",
        help="tokenizer directory for the token view (default: the bundled Qwen3 one, if any)",
    )
    inspect.set_defaults(handler=_inspect)

    dashboard = services.add_parser("dashboard", help="live view of a pool and its agents")
    dashboard.add_argument("--pool", required=True, help="PoolService host:port")
    dashboard.add_argument(
        "--agent", action="append", help="AgentService host:port (repeat for several)"
    )
    dashboard.add_argument("--token", help="bearer token of the services (default: $SWERL_TOKEN)")
    dashboard.add_argument("--host", default="127.0.0.1", help="address to bind")
    dashboard.add_argument("--port", type=_port, default=8322, help="port (0: any free one)")
    dashboard.add_argument("--interval", type=float, default=2.0, help="seconds between polls")
    dashboard.set_defaults(handler=_dashboard)
