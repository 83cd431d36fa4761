"""The commands of one call, from what the caller sends to what it is sent back (no protos here).

An Exec call runs one command; an ExecCommands call runs many, one after another, over one
stream. The transport decodes each request message into a `CommandInput` (a `decode` function it
passes in, so messages go through no extra generator) and maps the events that come out to its
own messages; everything between is here:

- a reader turns each `StartCommand` into a run (lease token checked, spec validated) or into the
  error that ends the call, and queues it; signals and stdin go to the oldest unfinished run;
- the commands run in arrival order, and their events stream out as the shell produces them;
- a short command's last output travels with its exit as one `CommandEnd` (one message instead
  of two): output seen while the command still runs waits `OUTPUT_LINGER_S` for that exit;
- a caller that goes away abandons what it started (the shell kills it and stays in step).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

from swerl.exec.errors import EmptyCommand, ExecStartRequired, InvalidCommand, StdinNotOpen
from swerl.exec.settings import ExecSettings
from swerl.exec.shell import CommandRun, CommandSpec, Exit, Output, Started

# How long output waits for the command's exit to travel with it (ExecCommands): long enough
# for a short command's end marker to follow its output, too short to notice in a live stream.
OUTPUT_LINGER_S = 0.002

Message = TypeVar("Message")


@dataclass(frozen=True, slots=True)
class StartCommand:
    sandbox_id: str
    spec: CommandSpec


@dataclass(frozen=True, slots=True)
class SignalCommand:
    signal: str  # "INT" | "TERM" | "KILL"


@dataclass(frozen=True, slots=True)
class CommandStdin:
    data: bytes
    close: bool


# What a caller sends; a message that decodes to None (e.g. an unknown signal) is ignored.
CommandInput = StartCommand | SignalCommand | CommandStdin


@dataclass(frozen=True, slots=True)
class CommandEnd:
    """A finished command's last output chunks and its exit, to go out together."""

    output: list[Output]
    exit: Exit


CommandEvent = Started | Output | Exit | CommandEnd


def check_command(spec: CommandSpec, sandbox_id: str) -> None:
    """Refuses an empty command and a negative timeout or output cap (zero is the default)."""
    if not spec.command.strip():
        raise EmptyCommand("command is empty", sandbox_id=sandbox_id)
    if spec.timeout_s < 0 or spec.max_output_bytes < 0:
        raise InvalidCommand(
            f"timeout ({spec.timeout_s:g} s) and max_output_bytes ({spec.max_output_bytes})"
            " cannot be negative (zero means the node's default)",
            sandbox_id=sandbox_id,
        )


def with_node_defaults(spec: CommandSpec, settings: ExecSettings, workdir: str) -> CommandSpec:
    """The one place a command's zeros become the node's defaults: no cwd runs in the sandbox's
    workdir (a SESSION command stays where the session is), no timeout is
    `default_timeout_s`, no output cap `default_max_output_bytes`; every cap is held to
    `max_output_bytes_limit`."""
    return replace(
        spec,
        cwd=spec.cwd or ("" if spec.session else workdir),
        timeout_s=spec.timeout_s or settings.default_timeout_s,
        max_output_bytes=min(
            spec.max_output_bytes or settings.default_max_output_bytes,
            settings.max_output_bytes_limit,
        ),
    )


class CommandHost(Protocol):
    """What the pipeline needs of the sandbox manager."""

    def check_lease_token(self, sandbox_id: str, token: str | None) -> None: ...

    def start_command(self, sandbox_id: str, spec: CommandSpec) -> CommandRun: ...


def _start(host: CommandHost, command: StartCommand, lease_token: str | None) -> CommandRun:
    host.check_lease_token(command.sandbox_id, lease_token)
    return host.start_command(command.sandbox_id, command.spec)


async def run_command(
    host: CommandHost,
    requests: AsyncIterable[Message],
    decode: Callable[[Message], CommandInput | None],
    lease_token: str | None,
) -> AsyncIterator[Started | Output | Exit]:
    """One command (Exec): the first message starts it, later ones signal it or feed its stdin.

    A protocol error on the inputs (stdin that was not opened) kills the command and, once its
    exit has come, fails the call.
    """
    iterator = aiter(requests)
    first = await anext(iterator, None)
    start = decode(first) if first is not None else None
    if not isinstance(start, StartCommand):
        raise ExecStartRequired("the first Exec message must be `start`")
    run = _start(host, start, lease_token)
    inputs = asyncio.get_running_loop().create_task(
        _pump_inputs(iterator, decode, run, start.spec.open_stdin)
    )
    finished = False
    try:
        async for event in run.events():
            if isinstance(event, Exit):
                finished = True
                failure = inputs.exception() if inputs.done() and not inputs.cancelled() else None
                if failure is not None:
                    raise failure  # e.g. StdinNotOpen: the call fails with it
            yield event
    finally:
        if not finished:
            run.abandon()
        inputs.cancel()
        with contextlib.suppress(BaseException):
            await inputs


async def _pump_inputs(
    requests: AsyncIterator[Message],
    decode: Callable[[Message], CommandInput | None],
    run: CommandRun,
    open_stdin: bool,
) -> None:
    async for message in requests:
        command = decode(message)
        if isinstance(command, SignalCommand):
            run.request_signal(command.signal)
        elif isinstance(command, CommandStdin):
            if not open_stdin:
                # A protocol error fails the whole call and, like a cancel, kills the command.
                run.request_signal("KILL")
                raise StdinNotOpen("stdin was not opened (set start.open_stdin)")
            await run.write_stdin(command.data, command.close)


async def run_commands(
    host: CommandHost,
    requests: AsyncIterable[Message],
    decode: Callable[[Message], CommandInput | None],
    lease_token: str | None,
) -> AsyncIterator[CommandEvent]:
    """Many commands (ExecCommands), one after another, each answered like an Exec call.

    An error starting a command (unknown sandbox, bad token, bad spec) or a protocol error ends
    the call with that error once the commands queued before it are done.
    """
    queued: asyncio.Queue[CommandRun | Exception | None] = asyncio.Queue()
    unfinished: collections.deque[CommandRun] = collections.deque()
    reader = asyncio.get_running_loop().create_task(
        _read_commands(host, requests, decode, lease_token, queued, unfinished)
    )
    try:
        while True:
            run = await queued.get()
            if run is None:
                return
            if isinstance(run, Exception):
                raise run
            # Output already followed by the exit (the run has finished) goes out with the exit
            # in one CommandEnd. The last chunk seen while the command runs waits a moment for
            # that exit.
            last: list[Output] | None = None
            async for event in run.events():
                if isinstance(event, Output):
                    if not run.finished and not run.events_waiting:
                        await run.settle(OUTPUT_LINGER_S)
                    if not run.finished:
                        yield event
                    elif last is None:
                        last = [event]
                    else:
                        last.append(event)
                elif isinstance(event, Exit) and last:
                    yield CommandEnd(last, event)
                else:
                    yield event
    finally:
        for run in unfinished:
            run.abandon()
        reader.cancel()
        with contextlib.suppress(BaseException):
            await reader


async def _read_commands(
    host: CommandHost,
    requests: AsyncIterable[Message],
    decode: Callable[[Message], CommandInput | None],
    lease_token: str | None,
    queued: asyncio.Queue[CommandRun | Exception | None],
    unfinished: collections.deque[CommandRun],
) -> None:
    try:
        async for message in requests:
            command = decode(message)
            if isinstance(command, StartCommand):
                run = _start(host, command, lease_token)
                unfinished.append(run)
                queued.put_nowait(run)
                continue
            if command is None:
                continue
            while unfinished and unfinished[0].finished:
                unfinished.popleft()
            target = unfinished[0] if unfinished else None
            if isinstance(command, SignalCommand):
                if target is not None:
                    target.request_signal(command.signal)
            else:
                if target is None or not target.spec.open_stdin:
                    if target is not None:
                        target.request_signal("KILL")
                    raise StdinNotOpen("stdin was not opened (set start.open_stdin)")
                await target.write_stdin(command.data, command.close)
    except Exception as exc:  # ends the call once the commands queued before it are done
        queued.put_nowait(exc)
    else:
        queued.put_nowait(None)
