"""The one client of an exec node: its SandboxService and EvaluateService, for every process that
calls a node (the agent, the tools, the trainer's helpers, tests).

    async with pool.lease(image) as lease:                 # swerl.pool.client: the lease only
        node = SandboxClient.for_lease(lease)              # the lease's node, its token attached
        result = await node.run(lease.sandbox_id, "pytest -x", timeout_s=600)
        patch = (await node.diff(lease.sandbox_id)).patch

Every call's deadline comes from the node's own bound on the work (swerl.exec.settings: a
command's timeout, the diff script's, a harness bundle's build step, an evaluation's tests),
derived once in this module's deadlines; calls the node bounds by nothing of its own (create,
destroy, look-ups) get the client's `timeout_s`. A new node RPC is a proto, a servicer method
and a method here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import ParamSpec, Protocol, cast

import grpc
from google.protobuf import timestamp_pb2

from swerl.chassis.capability import LEASE_TOKEN_METADATA_KEY
from swerl.chassis.client import make_channel
from swerl.chassis.timeconv import duration_pb as duration
from swerl.exec.outcome import ExecResult
from swerl.exec.settings import (
    DEFAULT_COMMAND_TIMEOUT_S,
    DEFAULT_EVALUATION_TIMEOUT_S,
    DEFAULT_SANDBOX_TTL_S,
    DIFF_TIMEOUT_S,
    HARNESS_BUILD_STEP_TIMEOUT_S,
)
from swerl.exec.v1 import evaluate_pb2, evaluate_pb2_grpc, sandbox_pb2_grpc
from swerl.exec.v1 import sandbox_pb2 as pb

P = ParamSpec("P")

# Options for a channel to an exec node that must hear of the node's fault in seconds: a node
# stopped (SIGSTOP) or cut off answers nothing, and a command's stream is silent while it runs,
# so only pings find out. One every 2 s, answered within 2 s, ends every call in flight on a
# stopped node UNAVAILABLE within ~4 s, not at its 60/120 s deadline. The node accepts pings
# this often (swerl.chassis.server.SERVER_OPTIONS). gRPC core (1.85) bounds the wait for a
# ping's answer by `grpc.http2.ping_timeout_ms` (a minute by default), not by
# `grpc.keepalive_timeout_ms` alone: both are set. A call made once the connection is gone
# waits for a new one, whose attempt a stopped node (its kernel still accepts) never answers:
# gRPC gives up on an attempt after `grpc.min_reconnect_backoff_ms` (20 s by default), so 2 s
# here (and a restarted node is reached again within a second, not after minutes of backoff).
NODE_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.http2.ping_timeout_ms", 2_000),
    ("grpc.min_reconnect_backoff_ms", 2_000),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)

# -- deadlines ----------------------------------------------------------------------------------
# Each call's deadline is derived here, once, from the node's own bound on the work
# (swerl.exec.settings); a caller names none of these numbers.
#
# A command's result is awaited for its timeout plus this margin before the client gives up.
COMMAND_DEADLINE_MARGIN_S = 30.0
# A CommandStream's one call lives at most this long when no command needs longer (it is opened
# again sooner anyway, see MAX_CALL_AGE_S): no sandbox of the node's default lifetime outlives it.
COMMANDS_CALL_DEADLINE_S = DEFAULT_SANDBOX_TTL_S
# Calls the node bounds by nothing of its own (create, destroy, renew, look-ups): the default of
# `SandboxClient(timeout_s=)`.
CALL_TIMEOUT_S = 60.0
# GetDiff: as long as the node lets the diff script run. A script that takes all of it ends here
# in DEADLINE_EXCEEDED rather than in the node's own answer.
DIFF_DEADLINE_S = DIFF_TIMEOUT_S
# OpenHarness: a first call on a node builds the harness's bundle; it is awaited as long as the
# node lets one build step (a `pip download`, an `npm install`) run.
OPEN_HARNESS_DEADLINE_S = HARNESS_BUILD_STEP_TIMEOUT_S
# Evaluate: beyond its tests' limit, the phases around them (the patch and the test patch
# applied, the grading, the report)...
EVALUATE_OVERHEAD_S = 120.0
# ...and, for a request that names no sandbox, the node's own evaluation sandbox created first.
EVALUATE_OWN_SANDBOX_S = 180.0
# While a pool is away, a lease holder renews its sandbox on the node itself (`hold_sandbox`):
# a node that does not answer within this is tried again at the lease's next renewal.
HOLD_TIMEOUT_S = 5.0
# EnsureImages: the node bounds a pull by nothing (images of any size), so a whole call's
# default; the leases or the operator waiting on the pulls have their own deadlines.
ENSURE_IMAGES_TIMEOUT_S = 3600.0


def command_deadline_s(timeout_s: float) -> float:
    """How long a command's result is awaited: its timeout (0: the node's default) plus the
    margin; past it the client gives up and the command is killed."""
    return (timeout_s or DEFAULT_COMMAND_TIMEOUT_S) + COMMAND_DEADLINE_MARGIN_S


def evaluate_deadline_s(timeout_s: float, *, own_sandbox: bool) -> float:
    """How long an Evaluate is awaited: its tests' limit (0: the node's default), the phases
    around them, and the node's own sandbox when the request names none."""
    deadline = (timeout_s or DEFAULT_EVALUATION_TIMEOUT_S) + EVALUATE_OVERHEAD_S
    return deadline + (EVALUATE_OWN_SANDBOX_S if own_sandbox else 0.0)


def start_message(
    sandbox_id: str,
    command: str,
    *,
    cwd: str = "",
    env: Mapping[str, str] | None = None,
    timeout_s: float = 0.0,
    max_output_bytes: int = 0,
    session: bool = False,
    open_stdin: bool = False,
    notify_started: bool = False,
) -> pb.ExecStart:
    """One command as the node reads it. Zero (or empty) means the node's default: the cwd is
    the sandbox's workdir, the timeout `ExecSettings.default_timeout_s`, the output cap
    `default_max_output_bytes`; `session` runs it in the sandbox's persistent shell."""
    return pb.ExecStart(
        sandbox_id=sandbox_id,
        command=command,
        cwd=cwd,
        env=env or None,
        timeout=duration(timeout_s) if timeout_s else None,
        max_output_bytes=max_output_bytes,
        mode=pb.EXEC_MODE_SESSION if session else pb.EXEC_MODE_ISOLATED,
        open_stdin=open_stdin,
        notify_started=notify_started,
    )


def _as_request(build: Callable[P, pb.ExecStart]) -> Callable[P, pb.ExecRequest]:
    """An Exec call's first request from a `start` builder, with the builder's own signature."""

    def request(*args: P.args, **kwargs: P.kwargs) -> pb.ExecRequest:
        return pb.ExecRequest(start=build(*args, **kwargs))

    return request


# The `start` request of an Exec call: `start_message`'s arguments, typed as they are there.
exec_start = _as_request(start_message)


async def collect(responses: AsyncIterator[pb.ExecResponse]) -> ExecResult:
    out = {pb.OUTPUT_STREAM_STDOUT: bytearray(), pb.OUTPUT_STREAM_STDERR: bytearray()}
    async for response in responses:
        kind = response.WhichOneof("kind")
        if kind == "output":
            out[response.output.stream] += response.output.data
        elif kind == "exit":
            return _result(response.exit, out)
    raise _ended_without_exit("Exec stream")


def _ended_without_exit(what: str) -> grpc.aio.AioRpcError:
    # A call the node ended cleanly before the command's exit (the node stopping, say) is a
    # transport failure to the caller like any other, not a bug in the caller: UNAVAILABLE.
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        f"{what} ended without an exit message",
    )


def _result(e: pb.ExecExit, out: Mapping[pb.OutputStream, bytearray]) -> ExecResult:
    return ExecResult(
        exit_code=e.exit_code,
        stdout=bytes(out[pb.OUTPUT_STREAM_STDOUT]),
        stderr=bytes(out[pb.OUTPUT_STREAM_STDERR]),
        timed_out=e.timed_out,
        output_truncated=e.output_truncated,
        bytes_dropped=e.bytes_dropped,
        duration_s=e.duration.seconds + e.duration.nanos / 1e9,
        signaled=e.signaled,
        sandbox_restarted=e.sandbox_restarted,
    )


class NodeLease(Protocol):
    """What `SandboxClient.for_lease` needs of a lease on a node (`swerl.pool.client.Lease` is
    one): where the sandbox is, the credentials to reach it, and a place to attach the client."""

    node_address: str
    # The lease's current capability token (renewed while the lease lives).
    token: str
    # The deployment's bearer token and CA, as the lease holder reached the pool with.
    auth_token: str | None
    tls_ca_file: str | None

    def attach_node(self, node: SandboxClient) -> None: ...


class SandboxClient:
    """An exec node's SandboxService and EvaluateService over one channel.

    `timeout_s` is the deadline of the calls the node bounds by nothing of its own; every other
    call's deadline is derived from the node's bound (see the module's deadlines). `stub` and
    `evaluate_stub` are the raw contract, for the tests of the contract itself: a caller that
    needs a call this client lacks adds it here."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        timeout_s: float = CALL_TIMEOUT_S,
        owns_channel: bool = False,
    ) -> None:
        self.channel = channel
        self.stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        self.evaluate_stub = evaluate_pb2_grpc.EvaluateServiceStub(channel)
        self.timeout_s = timeout_s
        self._owns_channel = owns_channel
        self._streams: dict[str, CommandStream] = {}

    @classmethod
    def for_lease(cls, lease: NodeLease) -> SandboxClient:
        """A client of a lease's node (`swerl.pool.client.Lease`): it dials the node with the
        lease holder's credentials and sends the lease's current capability token on every
        call. It is attached to the lease, which renews the sandbox through it while the pool is
        away (`hold_sandbox`) and closes it when the lease is released."""

        def token_metadata() -> list[tuple[str, str]]:
            return [(LEASE_TOKEN_METADATA_KEY, lease.token)] if lease.token else []

        channel = make_channel(
            lease.node_address,
            token=lease.auth_token,
            tls_ca_file=lease.tls_ca_file,
            metadata_provider=token_metadata,
            extra_options=NODE_CHANNEL_OPTIONS,
        )
        client = cls(channel, owns_channel=True)
        lease.attach_node(client)
        return client

    async def run(
        self,
        sandbox_id: str,
        command: str,
        *,
        cwd: str = "",
        env: Mapping[str, str] | None = None,
        timeout_s: float = 0.0,
        max_output_bytes: int = 0,
        session: bool = False,
        open_stdin: bool = False,
        notify_started: bool = False,
        deadline_s: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Runs one command and gathers its output (the arguments of `start_message`; `stdin`:
        bytes for its stdin, then end of file).

        Commands on one sandbox go over one ExecCommands call, kept open between them (see
        `CommandStream`); a failed command raises the node's `grpc.aio.AioRpcError` as an Exec
        call would. The wait is bounded by the command timeout plus a margin unless given
        (DEADLINE_EXCEEDED, and the command is killed)."""
        stream = self._streams.get(sandbox_id)
        if stream is None:
            stream = self._streams[sandbox_id] = CommandStream(self.stub, sandbox_id)
        return await stream.run(
            command,
            cwd=cwd,
            env=env,
            timeout_s=timeout_s,
            max_output_bytes=max_output_bytes,
            session=session,
            open_stdin=open_stdin,
            notify_started=notify_started,
            deadline_s=deadline_s,
            stdin=stdin,
        )

    def commands(
        self,
        sandbox_id: str,
        *,
        deadline_s: float = COMMANDS_CALL_DEADLINE_S,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> CommandStream:
        """A `CommandStream` of its own on one sandbox: many commands over one call."""
        return CommandStream(self.stub, sandbox_id, deadline_s=deadline_s, metadata=metadata)

    async def aclose(self) -> None:
        """Ends the calls `run` keeps open. A channel this client opened (`for_lease`) is closed
        first, which ends every call on it at once: a released lease waits for nothing from a
        node that may not answer; a channel the caller gave is left open, its calls half-closed."""
        streams, self._streams = list(self._streams.values()), {}
        if self._owns_channel:
            await self.channel.close()
        for stream in streams:
            await stream.aclose()

    def exec_call(
        self, *, timeout_s: float, metadata: Sequence[tuple[str, str]] | None = None
    ) -> grpc.aio.StreamStreamCall:
        """An Exec call to drive by hand (a caller that streams stdin or signals itself; `run`
        is the usual way). `timeout_s`: the caller's bound on the whole call."""
        return self.stub.Exec(metadata=_metadata(metadata), timeout=timeout_s)

    def commands_call(
        self, *, timeout_s: float, metadata: Sequence[tuple[str, str]] | None = None
    ) -> grpc.aio.StreamStreamCall:
        """An ExecCommands call to drive by hand (`commands` wraps one in a CommandStream)."""
        return self.stub.ExecCommands(metadata=_metadata(metadata), timeout=timeout_s)

    # -- sandboxes -------------------------------------------------------------------------
    async def create_sandbox(
        self,
        image: str,
        *,
        request_id: str | None = None,
        workdir: str = "",
        env: Mapping[str, str] | None = None,
        ttl_s: float = 0.0,
        owner: str = "",
        instance_id: str = "",
        labels: Mapping[str, str] | None = None,
    ) -> pb.Sandbox:
        """CreateSandbox (tools and tests; the pool creates a lease's sandbox itself). Zero or
        empty fields take the node's defaults; the image must be on the node already."""
        request = pb.CreateSandboxRequest(
            request_id=request_id or uuid.uuid4().hex,
            image=image,
            workdir=workdir,
            env=dict(env or {}),
            labels=dict(labels or {}),
            ttl=duration(ttl_s) if ttl_s else None,
            owner=owner,
            instance_id=instance_id,
        )
        return (await self.stub.CreateSandbox(request, timeout=self.timeout_s)).sandbox

    async def destroy_sandbox(self, sandbox_id: str) -> bool:
        """DestroySandbox; False when the node had no such sandbox (idempotent)."""
        request = pb.DestroySandboxRequest(sandbox_id=sandbox_id)
        return (await self.stub.DestroySandbox(request, timeout=self.timeout_s)).existed

    async def get_sandbox(self, sandbox_id: str, *, timeout_s: float | None = None) -> pb.Sandbox:
        request = pb.GetSandboxRequest(sandbox_id=sandbox_id)
        response = await self.stub.GetSandbox(request, timeout=timeout_s or self.timeout_s)
        return response.sandbox

    async def renew_sandbox(
        self,
        sandbox_id: str,
        ttl_s: float,
        *,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> pb.Sandbox:
        """RenewSandbox: the sandbox's expiry becomes now + `ttl_s` (0: the node's default)."""
        request = pb.RenewSandboxRequest(
            request_id=request_id or uuid.uuid4().hex,
            sandbox_id=sandbox_id,
            ttl=duration(ttl_s),
        )
        response = await self.stub.RenewSandbox(request, timeout=timeout_s or self.timeout_s)
        return response.sandbox

    async def hold_sandbox(self, sandbox_id: str, hold_s: float) -> float:
        """Keeps the sandbox on the node for at least `hold_s` more seconds and returns the
        node's expiry for it (epoch seconds). The expiry only ever moves later: the pool may
        have set it further than `hold_s`. What a lease holder does while the pool is away;
        a sandbox the node no longer has fails NOT_FOUND."""
        sandbox = await self.get_sandbox(sandbox_id, timeout_s=HOLD_TIMEOUT_S)
        expire = _epoch_s(sandbox.expire_time)
        if expire < time.time() + hold_s:
            sandbox = await self.renew_sandbox(sandbox_id, hold_s, timeout_s=HOLD_TIMEOUT_S)
            expire = _epoch_s(sandbox.expire_time)
        return expire

    async def diff(
        self,
        sandbox_id: str,
        *,
        include_untracked: bool = True,
        base_ref: str = "",
        path: str = "",
    ) -> pb.GetDiffResponse:
        """GetDiff: the sandbox's changes as one binary-safe patch (untracked files included
        unless told otherwise) against `base_ref` (HEAD) of the repository at `path` (the
        sandbox's workdir)."""
        request = pb.GetDiffRequest(
            sandbox_id=sandbox_id, include_untracked=include_untracked, base_ref=base_ref, path=path
        )
        return await self.stub.GetDiff(request, timeout=DIFF_DEADLINE_S)

    async def open_harness(
        self,
        sandbox_id: str,
        harness: str,
        *,
        gateway_url: str,
        gateway_api_key: str = "",
        version: str = "",
    ) -> pb.OpenHarnessResponse:
        """OpenHarness: the harness's bundle (built first on a node that lacks it) and the
        sandbox's socket to `gateway_url`."""
        request = pb.OpenHarnessRequest(
            sandbox_id=sandbox_id,
            harness=harness,
            version=version,
            gateway_url=gateway_url,
            gateway_api_key=gateway_api_key,
        )
        return await self.stub.OpenHarness(request, timeout=OPEN_HARNESS_DEADLINE_S)

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(
        self,
        instance: evaluate_pb2.SweInstance,
        patch: bytes,
        *,
        sandbox_id: str = "",
        timeout_s: float = 0.0,
        omit_logs: bool = True,
        request_id: str | None = None,
    ) -> AsyncIterator[evaluate_pb2.EvaluateResponse]:
        """Evaluate's stream (phases, logs unless omitted, then the report): `patch` graded in
        `sandbox_id`, or in a fresh sandbox of the instance's image when empty; `timeout_s`
        bounds the tests (0: the node's default)."""
        request = evaluate_pb2.EvaluateRequest(
            request_id=request_id or uuid.uuid4().hex,
            sandbox_id=sandbox_id,
            instance=instance,
            patch=patch,
            timeout=duration(timeout_s) if timeout_s else None,
            omit_logs=omit_logs,
        )
        deadline = evaluate_deadline_s(timeout_s, own_sandbox=not sandbox_id)
        responses: AsyncIterator[evaluate_pb2.EvaluateResponse] = self.evaluate_stub.Evaluate(
            request, timeout=deadline
        )
        return responses

    async def evaluation_report(
        self,
        instance: evaluate_pb2.SweInstance,
        patch: bytes,
        *,
        sandbox_id: str = "",
        timeout_s: float = 0.0,
        request_id: str | None = None,
    ) -> evaluate_pb2.EvaluationReport | None:
        """Evaluate (logs omitted) to its report; None when the stream ended without one."""
        report = None
        stream = self.evaluate(
            instance, patch, sandbox_id=sandbox_id, timeout_s=timeout_s, request_id=request_id
        )
        async for response in stream:
            if response.WhichOneof("kind") == "report":
                report = response.report
        return report

    # -- the node and its images -------------------------------------------------------------
    async def node_info(self) -> pb.GetNodeInfoResponse:
        """GetNodeInfo: the node's id, capacity, load, version and Docker health."""
        return await self.stub.GetNodeInfo(pb.GetNodeInfoRequest(), timeout=self.timeout_s)

    async def list_images(self) -> list[pb.Image]:
        """ListImages: the images present on the node."""
        response = await self.stub.ListImages(pb.ListImagesRequest(), timeout=self.timeout_s)
        return list(response.images)

    def ensure_images(
        self,
        images: Sequence[str],
        *,
        mirror_prefix: str = "",
        concurrency: int = 0,
        request_id: str | None = None,
        timeout_s: float = ENSURE_IMAGES_TIMEOUT_S,
    ) -> AsyncIterator[pb.EnsureImagesResponse]:
        """EnsureImages' stream: progress, then one result per image (pulled, present, or
        failed with the node's reason). `concurrency` 0: the node's default."""
        request = pb.EnsureImagesRequest(
            request_id=request_id or uuid.uuid4().hex,
            images=list(images),
            mirror_prefix=mirror_prefix,
            concurrency=concurrency,
        )
        responses: AsyncIterator[pb.EnsureImagesResponse] = self.stub.EnsureImages(
            request, timeout=timeout_s
        )
        return responses


def _metadata(pairs: Sequence[tuple[str, str]] | None) -> tuple[tuple[str, str], ...] | None:
    return tuple(pairs) if pairs is not None else None


def _epoch_s(ts: timestamp_pb2.Timestamp) -> float:
    return float(ts.seconds + ts.nanos / 1e9)


# Stdin bytes per ExecStdin message.
STDIN_CHUNK_BYTES = 1 << 20
# A call is not reused past this age: per-call metadata (a lease's capability token, renewed
# while the lease lives) is read when a call opens, so a fresh call picks up the current one.
# An idle call is half-closed after it, so a client leaves nothing open on a node it stopped
# using.
MAX_CALL_AGE_S = 60.0


class CommandStream:
    """Runs commands on one sandbox, one after another, over one ExecCommands call.

    This is how a client that runs a series of commands (an agent's episode) talks to the node:
    each command costs a message each way instead of a whole call, which on a small node is
    most of the cost of a short command. The call is opened on the first command and opened
    again when it ended (an error), is older than MAX_CALL_AGE_S, or could not outlive the next
    command's deadline. Concurrent `run`s take turns, in arrival order.

        async with client.commands(sandbox_id) as shell:
            result = await shell.run("pytest -x", timeout_s=600)
    """

    def __init__(
        self,
        stub: sandbox_pb2_grpc.SandboxServiceStub,
        sandbox_id: str,
        *,
        deadline_s: float = COMMANDS_CALL_DEADLINE_S,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        self._stub = stub
        self.sandbox_id = sandbox_id
        self._deadline_s = deadline_s
        self._metadata = metadata
        self._call: grpc.aio.StreamStreamCall | None = None
        self._opened_at = 0.0
        self._call_ends_at = 0.0
        self._turn = asyncio.Lock()
        self._idle: asyncio.TimerHandle | None = None
        self._closing: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> CommandStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def run(
        self,
        command: str,
        *,
        cwd: str = "",
        env: Mapping[str, str] | None = None,
        timeout_s: float = 0.0,
        max_output_bytes: int = 0,
        session: bool = False,
        open_stdin: bool = False,
        notify_started: bool = False,
        deadline_s: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Runs one command and gathers its output (the arguments of `start_message`). A failed
        command raises the call's `grpc.aio.AioRpcError`; the next run opens a new call. The
        wait is bounded by `deadline_s` (default: the command timeout plus a margin). `stdin`:
        bytes the command reads on its stdin, then end of file (exact bytes, no shell quoting;
        the agent's file editor writes files this way)."""
        request = pb.ExecCommandsRequest(
            start=start_message(
                self.sandbox_id,
                command,
                cwd=cwd,
                env=env,
                timeout_s=timeout_s,
                max_output_bytes=max_output_bytes,
                session=session,
                open_stdin=open_stdin or stdin is not None,
                notify_started=notify_started,
            )
        )
        if deadline_s is None:
            deadline_s = command_deadline_s(timeout_s)
        loop = asyncio.get_running_loop()
        async with self._turn:
            if self._idle is not None:
                self._idle.cancel()
            now = loop.time()
            call = self._call
            if (
                call is None
                or call.done()
                or now - self._opened_at > MAX_CALL_AGE_S
                or now + deadline_s > self._call_ends_at
            ):
                self._retire(call)
                call_timeout = max(self._deadline_s, deadline_s + MAX_CALL_AGE_S)
                call = self._call = self._stub.ExecCommands(
                    metadata=self._metadata, timeout=call_timeout
                )
                self._opened_at, self._call_ends_at = now, now + call_timeout
            expired = False

            def expire() -> None:
                nonlocal expired
                expired = True
                call.cancel()  # kills the command on the node and ends the read below

            timer = loop.call_later(deadline_s, expire)
            try:
                return await self._exchange(call, request, stdin)
            except BaseException as exc:
                # The call's state is unknown (an error ended it, or we stopped reading
                # half-way): never reuse it.
                self._call = None
                call.cancel()
                if expired and isinstance(exc, asyncio.CancelledError):
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.aio.Metadata(),
                        grpc.aio.Metadata(),
                        f"no exit within {deadline_s:g} s",
                    ) from None
                if isinstance(exc, grpc.aio.AioRpcError):
                    # A send that failed in the transport, told at the write or (seen in CI: a
                    # SIGSTOPped node under load) at the next read: one place maps both.
                    told = send_failure(exc)
                    if told is not exc:
                        raise told from None
                raise
            finally:
                timer.cancel()
                if self._call is not None:
                    self._idle = loop.call_later(MAX_CALL_AGE_S, self._close_idle)

    @staticmethod
    async def _exchange(
        call: grpc.aio.StreamStreamCall, request: pb.ExecCommandsRequest, stdin: bytes | None
    ) -> ExecResult:
        out = {pb.OUTPUT_STREAM_STDOUT: bytearray(), pb.OUTPUT_STREAM_STDERR: bytearray()}
        await call.write(request)
        if stdin is not None:
            # In pieces well under gRPC's default 4 MiB message limit; the last closes stdin.
            pieces = [
                stdin[i : i + STDIN_CHUNK_BYTES] for i in range(0, len(stdin), STDIN_CHUNK_BYTES)
            ]
            for index, piece in enumerate(pieces or [b""]):
                last = index == max(len(pieces), 1) - 1
                await call.write(pb.ExecCommandsRequest(stdin=pb.ExecStdin(data=piece, close=last)))
        while True:
            read = await call.read()
            if read is grpc.aio.EOF:
                raise _ended_without_exit("ExecCommands call")
            message = cast(pb.ExecCommandsResponse, read)
            kind = message.WhichOneof("kind")
            if kind == "output":
                out[message.output.stream] += message.output.data
            elif kind == "exit":
                return _result(message.exit, out)
            elif kind == "end":
                for chunk in message.end.output:
                    out[chunk.stream] += chunk.data
                return _result(message.end.exit, out)

    def _retire(self, call: grpc.aio.StreamStreamCall | None) -> None:
        """Half-closes an idle call in the background (the node then ends it)."""
        self._call = None
        if call is None or call.done():
            return
        task = asyncio.get_running_loop().create_task(_half_close(call))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _close_idle(self) -> None:
        self._idle = None
        if not self._turn.locked():
            self._retire(self._call)

    async def aclose(self) -> None:
        """Half-closes the call and waits for it to end."""
        if self._idle is not None:
            self._idle.cancel()
        call, self._call = self._call, None
        if call is not None:
            await _half_close(call)
        for task in list(self._closing):
            with contextlib.suppress(BaseException):
                await task


def send_failure(err: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    """What a failed write of a stream tells its caller. gRPC's asyncio calls end a stream whose
    send failed in the transport (the connection broke under it, e.g. a node stopped or gone)
    INTERNAL "Internal error from Core" when that send loses the race with the connection's own
    status: that is the node being unreachable (UNAVAILABLE), as the same call a moment later
    is told. Any other error stays as it is."""
    if err.code() is grpc.StatusCode.INTERNAL and "execute_batch" in (
        err.debug_error_string() or ""
    ):
        return grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            f"the connection to the node failed while the request was sent (gRPC: {err.details()})",
            err.debug_error_string(),
        )
    return err


async def _half_close(call: grpc.aio.StreamStreamCall) -> None:
    if call.done():
        return
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass
