"""`swerl prm serve` (the PRM judge service) and `swerl prm scripted-judge` (a scripted judge
model server speaking SGLang's /generate, for demos and local runs without a GPU)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

from swerl.chassis.logging import configure_logging
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


def _scripted(args: argparse.Namespace) -> int:
    from swerl.chassis.hf import bundled_qwen3_tokenizer_dir
    from swerl.prm.scripted import Reply, ScriptedJudge

    configure_logging("console", "warning")
    replies = [Reply(text=text.replace("\\n", "\n"), delay_s=args.delay_s) for text in args.reply]
    judge = ScriptedJudge(
        args.tokenizer_path or bundled_qwen3_tokenizer_dir(), default=replies, host=args.host
    )

    async def main() -> None:
        # The handlers go in before the server says it serves: a signal sent the moment it
        # does must find them.
        with _stop_signals() as stop:
            await judge.start(args.port)
            print(f"scripted judge serving /generate on {judge.url}", flush=True)
            try:
                await stop.wait()
            finally:
                await judge.stop()

    asyncio.run(main())
    return 0


@contextlib.contextmanager
def _stop_signals() -> Iterator[asyncio.Event]:
    """An event set on the first SIGINT or SIGTERM while the block runs.

    The loop's own handlers, not Python's KeyboardInterrupt: a process started with SIGINT
    ignored (any background job of a non-interactive shell, so a test runner's or a script's
    children) inherits SIG_IGN, Python then installs no SIGINT handler and asyncio.run() none
    either, and the server never stopped on Ctrl-C or a supervisor's SIGINT. SIGTERM (what
    systemd and docker send) stops it the same way.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    try:
        yield stop
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


def register(subparsers: argparse._SubParsersAction) -> None:
    from swerl.prm.settings import PrmSettings

    prm = subparsers.add_parser("prm", help="the PRM judge service")
    commands = prm.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve PrmService over a judge model")
    add_settings_arguments(serve, PrmSettings)
    serve.set_defaults(handler=_serve)

    scripted = commands.add_parser(
        "scripted-judge", help="a scripted judge model server (SGLang /generate) for demos"
    )
    scripted.add_argument("--host", default="127.0.0.1", help="interface to bind")
    scripted.add_argument("--port", type=int, default=30000, help="HTTP port")
    scripted.add_argument(
        "--tokenizer-path", type=Path, help="judge tokenizer to decode prompts (default: Qwen3)"
    )
    scripted.add_argument(
        "--reply",
        nargs="+",
        default=["The step helps.\\n\\boxed{+1}"],
        help="answers played in order, the last repeating",
    )
    scripted.add_argument(
        "--delay-s", type=float, default=0.0, help="seconds each answer takes (model latency)"
    )
    scripted.set_defaults(handler=_scripted)
