"""The servers' ping allowance is an option gRPC reads: a silent stream whose client pings
more often than gRPC's default allowance (one ping per 5 min without data) stays open.

The soak found the opposite: an episode stream silent for ~90 s ended UNAVAILABLE (GOAWAY
too_many_pings) because the option's key was spelled after the C macro, which gRPC ignores.
"""

from __future__ import annotations

import asyncio

import grpc

from swerl.chassis.server import SERVER_OPTIONS
from swerl.exec.client import NODE_CHANNEL_OPTIONS

_ALLOWANCE_KEYS = [key for key, _ in SERVER_OPTIONS if "ping_interval_without_data" in key]


async def _silent_stream(request: bytes, context: grpc.aio.ServicerContext):
    yield b"first"
    await asyncio.sleep(5.0)  # No data either way; only the client's keepalive pings.
    yield b"second"


# A client pinging every second, idle or not: far more often than the default allowance.
_EVERY_SECOND = (
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
)


async def _stream_survives(
    server_options: list[tuple[str, int]],
    client_options: tuple[tuple[str, int], ...] = _EVERY_SECOND,
) -> bool:
    server = grpc.aio.server(options=server_options)
    handler = grpc.unary_stream_rpc_method_handler(
        _silent_stream, request_deserializer=bytes, response_serializer=bytes
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Silent", {"Watch": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{port}",
        options=[
            *client_options,
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ],
    )
    try:
        call = channel.unary_stream(
            "/test.Silent/Watch", request_serializer=bytes, response_deserializer=bytes
        )(b"", timeout=20)
        try:
            return [m async for m in call] == [b"first", b"second"]
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            return False
    finally:
        await channel.close()
        await server.stop(0)


async def test_the_servers_ping_allowance_keeps_a_silent_stream_open() -> None:
    assert len(_ALLOWANCE_KEYS) == 1
    options = [(k, v) for k, v in SERVER_OPTIONS if k not in _ALLOWANCE_KEYS]
    # The same key, with an allowance below the client's ping interval.
    assert await _stream_survives([*options, (_ALLOWANCE_KEYS[0], 500)])


async def test_without_the_allowance_the_same_stream_is_closed_for_too_many_pings() -> None:
    # The control: proves the client above pings often enough for the allowance to matter.
    options = [(k, v) for k, v in SERVER_OPTIONS if k not in _ALLOWANCE_KEYS]
    assert not await _stream_survives(options)


async def test_the_servers_own_allowance_keeps_an_exec_node_channels_silent_stream_open() -> None:
    # The agent's lease channels ping a node every 2 s (to hear of a stopped node in seconds):
    # the servers' own options must take that, or every long silent Exec would be cut.
    assert await _stream_survives(list(SERVER_OPTIONS), NODE_CHANNEL_OPTIONS)
