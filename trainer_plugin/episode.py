"""One episode over one `RunEpisode` stream: start, watch, cancel, and what came back.

`run_episode` sends `start` to an agent service, reads the stream while the episode runs, and
returns an `EpisodeOutcome`: the agent's `EpisodeResult`, or why there is none. It never raises
for anything that goes wrong on the wire; callers turn a missing result into a placeholder
sample. While the episode runs it looks at `should_cancel()` (slime's abort flag) every
`abort_poll_interval_s` and at the overall deadline; either sends `cancel` (the agent answers
with a CANCELLED result and releases the sandbox), and if no result arrives within
`cancel_grace_s` the call itself is cancelled, which also stops the episode on the agent. A
cancelled `generate` task (slime cancels pending rollout tasks on abort) cancels the call too.

Episodes are spread over the configured agent addresses: each new episode goes to the address
with the fewest episodes in flight from this process, ties in rotation. An agent that is
UNAVAILABLE before it sent anything is retried on the next address with swerl's one retry policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from swerl.agent.client import EpisodeCall, open_episode
from swerl.agent.v1 import agent_pb2, agent_pb2_grpc
from swerl.chassis.bounded import within
from swerl.chassis.client import CHANNEL_OPTIONS
from swerl.chassis.interceptors import AUTHORIZATION_METADATA_KEY, REQUEST_ID_METADATA_KEY
from swerl.chassis.retry import async_retrying
from swerl.trainer_plugin.settings import PluginSettings

# Reasons for an outcome without a result (EpisodeOutcome.failure_reason).
CLIENT_DEADLINE = "CLIENT_DEADLINE"
CANCEL_UNANSWERED = "CANCEL_UNANSWERED"
STREAM_ENDED_WITHOUT_RESULT = "STREAM_ENDED_WITHOUT_RESULT"


@dataclass
class EpisodeOutcome:
    """What one RunEpisode call produced."""

    episode_id: str
    address: str
    # The episode's result; with EpisodeOptions.branch, the last of its results (the stream is
    # complete once it is set). None when the stream ended without (all of) them.
    result: agent_pb2.EpisodeResult | None = None
    # Every result in arrival order: one, or with branching one per branch (or the trunk's one
    # unbranched result when it ended before the fork).
    results: list[agent_pb2.EpisodeResult] = field(default_factory=list)
    # Set when result is None: one of the constants above or "RPC_<grpc status code name>".
    failure_reason: str = ""
    failure_message: str = ""
    # "abort" or "deadline" when the plugin asked the agent to cancel.
    cancelled_by: str | None = None
    started: agent_pb2.EpisodeStarted | None = None
    turns: list[agent_pb2.EpisodeTurn] = field(default_factory=list)
    elapsed_s: float = 0.0


class AgentDirectory:
    """Channels to the agent services and the spreading of episodes over them.

    grpc.aio channels belong to the event loop they were made on, so channels are kept per
    loop (slime runs rollouts on one long-lived loop; tests make a loop per test).
    """

    def __init__(self, addresses: Sequence[str], settings: PluginSettings) -> None:
        self.addresses = list(addresses)
        self._settings = settings
        self._in_flight = dict.fromkeys(self.addresses, 0)
        self._rotation = itertools.count()
        self._unavailable_until: dict[str, float] = {}
        self._channels: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, dict[str, grpc.aio.Channel]
        ] = weakref.WeakKeyDictionary()

    def pick(self) -> str:
        """The address with the fewest episodes in flight among those not recently found
        UNAVAILABLE (all of them when every one was); ties in rotation."""
        now = time.monotonic()
        healthy = [a for a in self.addresses if self._unavailable_until.get(a, 0.0) <= now]
        pool = healthy or self.addresses
        least = min(self._in_flight[a] for a in pool)
        candidates = [a for a in pool if self._in_flight[a] == least]
        return candidates[next(self._rotation) % len(candidates)]

    def mark_unavailable(self, address: str) -> None:
        """Keeps new episodes away from `address` for a while (it refused a connection)."""
        self._unavailable_until[address] = time.monotonic() + self._settings.unavailable_cooldown_s

    def in_flight(self) -> dict[str, int]:
        return dict(self._in_flight)

    def stub(self, address: str) -> agent_pb2_grpc.AgentServiceStub:
        loop = asyncio.get_running_loop()
        channels = self._channels.setdefault(loop, {})
        channel = channels.get(address)
        if channel is None:
            channel = channels[address] = self._channel(address)
        return agent_pb2_grpc.AgentServiceStub(channel)

    def _channel(self, address: str) -> grpc.aio.Channel:
        limit = self._settings.max_receive_message_bytes
        options = [
            *(o for o in CHANNEL_OPTIONS if o[0] != "grpc.max_receive_message_length"),
            ("grpc.max_receive_message_length", limit),
        ]
        ca_file = self._settings.agent_tls_ca_file
        if ca_file is None:
            return grpc.aio.insecure_channel(address, options=options)
        credentials = grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes())
        return grpc.aio.secure_channel(address, credentials, options=options)

    def metadata(self, episode_id: str) -> tuple[tuple[str, str], ...]:
        # The episode id doubles as request id, so agent, pool and node logs line up with it.
        pairs = [(REQUEST_ID_METADATA_KEY, episode_id)]
        token = self._settings.agent_token
        if token is not None:
            pairs.append((AUTHORIZATION_METADATA_KEY, f"Bearer {token.get_secret_value()}"))
        return tuple(pairs)

    def enter(self, address: str) -> None:
        self._in_flight[address] += 1

    def leave(self, address: str) -> None:
        self._in_flight[address] -= 1


async def run_episode(
    start: agent_pb2.EpisodeStart,
    directory: AgentDirectory,
    settings: PluginSettings,
    should_cancel: Callable[[], bool],
) -> EpisodeOutcome:
    """Runs one episode to its result (or to the reason there is none). Never raises on RPC
    failures; re-raises `asyncio.CancelledError` after cancelling the call."""
    began = time.monotonic()
    deadline = began + settings.episode_deadline_s
    outcome: EpisodeOutcome | None = None
    try:
        async for attempt in async_retrying(
            max_attempts=settings.connect_attempts,
            max_delay_s=max(1.0, min(30.0, settings.episode_deadline_s / 4)),
            initial_wait_s=0.1,
            max_wait_s=1.0,
            reasons=(),
        ):
            with attempt:
                if attempt.retry_state.attempt_number > 1 and should_cancel():
                    outcome = EpisodeOutcome(
                        episode_id=start.episode_id,
                        address=",".join(directory.addresses),
                        failure_reason="RPC_UNAVAILABLE",
                        failure_message="rollout aborted while no agent was reachable",
                        cancelled_by="abort",
                    )
                    break
                outcome = await _attempt(start, directory, settings, should_cancel, deadline)
    except grpc.aio.AioRpcError as err:  # UNAVAILABLE on every attempt
        outcome = EpisodeOutcome(
            episode_id=start.episode_id,
            address=",".join(directory.addresses),
            failure_reason=f"RPC_{err.code().name}",
            failure_message=err.details() or "",
        )
    assert outcome is not None
    outcome.elapsed_s = time.monotonic() - began
    return outcome


async def _attempt(
    start: agent_pb2.EpisodeStart,
    directory: AgentDirectory,
    settings: PluginSettings,
    should_cancel: Callable[[], bool],
    deadline: float,
) -> EpisodeOutcome:
    """One RunEpisode call. Raises UNAVAILABLE (for the retry policy) only when the agent could
    not be reached and sent nothing; every other failure is recorded in the outcome."""
    address = directory.pick()
    outcome = EpisodeOutcome(episode_id=start.episode_id, address=address)
    remaining = max(0.0, deadline - time.monotonic())
    directory.enter(address)
    episode: EpisodeCall | None = None
    reader: asyncio.Future[None] | None = None
    try:
        # The gRPC deadline is only a backstop behind the plugin's own deadline and cancel grace.
        episode = await open_episode(
            directory.stub(address),
            start,
            metadata=directory.metadata(start.episode_id),
            timeout=remaining + settings.cancel_grace_s + 5.0,
        )
        reader = asyncio.ensure_future(_read(episode, outcome))
        await _watch(episode, reader, outcome, settings, should_cancel, deadline)
        if outcome.result is not None:
            # Half-close: nothing more to say, so a server still reading requests can finish.
            await episode.done_writing()
    except asyncio.CancelledError:
        if episode is not None:
            episode.abort()
        if reader is not None:
            reader.cancel()
        raise
    except grpc.aio.AioRpcError as err:
        _record_rpc_error(outcome, err)
    finally:
        directory.leave(address)
    if reader is not None and reader.done() and not reader.cancelled():
        failure = reader.exception()
        if isinstance(failure, grpc.aio.AioRpcError):
            _record_rpc_error(outcome, failure)
        elif failure is not None:
            _failed(outcome, "CLIENT_ERROR", repr(failure))
    if outcome.result is None and not outcome.failure_reason:
        _failed(outcome, STREAM_ENDED_WITHOUT_RESULT, "the agent ended the call without a result")
    nothing_arrived = outcome.started is None and not outcome.turns and not outcome.results
    if outcome.failure_reason == "RPC_UNAVAILABLE" and nothing_arrived:
        directory.mark_unavailable(address)
        if not should_cancel():
            raise _unavailable(outcome)
    return outcome


async def _watch(
    episode: EpisodeCall,
    reader: asyncio.Task[None],
    outcome: EpisodeOutcome,
    settings: PluginSettings,
    should_cancel: Callable[[], bool],
    deadline: float,
) -> None:
    cancel_sent_at: float | None = None
    while True:
        done, _ = await asyncio.wait({reader}, timeout=settings.abort_poll_interval_s)
        if done:
            return
        now = time.monotonic()
        if cancel_sent_at is None:
            why = "abort" if should_cancel() else ("deadline" if now >= deadline else None)
            if why is None:
                continue
            outcome.cancelled_by = why
            cancel_sent_at = now
            reason = "rollout aborted" if why == "abort" else "plugin deadline"
            with contextlib.suppress(asyncio.TimeoutError):
                # A stream that is already ending takes no cancel; the reader reports how.
                await within(episode.cancel(reason), settings.cancel_grace_s)
        elif now - cancel_sent_at >= settings.cancel_grace_s:
            episode.abort()
            reader.cancel()
            if outcome.result is None:
                reason = CANCEL_UNANSWERED if outcome.cancelled_by == "abort" else CLIENT_DEADLINE
                _failed(outcome, reason, f"no result {settings.cancel_grace_s}s after cancel")
            return


async def _read(episode: EpisodeCall, outcome: EpisodeOutcome) -> None:
    # The outcome shares the call's lists, filled as messages arrive; the stream ends after
    # the last result (the server ends the call right after it).
    outcome.turns, outcome.results = episode.turns, episode.results
    async for _ in episode.messages():
        outcome.started, outcome.result = episode.started, episode.result


def _record_rpc_error(outcome: EpisodeOutcome, err: grpc.aio.AioRpcError) -> None:
    if outcome.result is not None or outcome.failure_reason:
        return
    if err.code() == grpc.StatusCode.CANCELLED and outcome.cancelled_by is not None:
        return  # our own cancel; _watch already named the reason
    _failed(outcome, f"RPC_{err.code().name}", err.details() or "")


def _failed(outcome: EpisodeOutcome, reason: str, message: str) -> EpisodeOutcome:
    outcome.failure_reason = reason
    outcome.failure_message = message
    return outcome


def _unavailable(outcome: EpisodeOutcome) -> grpc.aio.AioRpcError:
    # Re-raised as UNAVAILABLE so the shared retry policy tries the next address.
    return grpc.aio.AioRpcError(
        code=grpc.StatusCode.UNAVAILABLE,
        initial_metadata=grpc.aio.Metadata(),
        trailing_metadata=grpc.aio.Metadata(),
        details=f"{outcome.address}: {outcome.failure_message}",
    )
