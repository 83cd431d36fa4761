"""ExecCommands: many commands over one call, each answered exactly like an Exec call; and the
back-to-back stress that guards against a lost exit (a hang) in the in-container supervisor."""

from __future__ import annotations

import asyncio
import hashlib
import shlex
import time

import grpc
from testkit.exec import RPC_TIMEOUT_S, assert_status, rpc_error

from swerl.chassis import capability
from swerl.exec.client import exec_start
from swerl.exec.v1 import sandbox_pb2 as pb

# Enough back-to-back commands that a rare lost exit (a race between a fast command's end and
# the supervisor's wait) would show up as a hang, yet a few seconds on a 2-core machine.
STRESS_COMMANDS = 2000


def _start(sandbox_id: str, command: str, **kwargs) -> pb.ExecCommandsRequest:
    return pb.ExecCommandsRequest(start=exec_start(sandbox_id, command, **kwargs).start)


async def _read_command(call) -> tuple[bytes, bytes, pb.ExecExit]:
    """The messages of one command on an ExecCommands call, up to its exit."""
    out = {pb.OUTPUT_STREAM_STDOUT: bytearray(), pb.OUTPUT_STREAM_STDERR: bytearray()}
    while True:
        message = await call.read()
        assert message is not grpc.aio.EOF, "the call ended before the command's exit"
        kind = message.WhichOneof("kind")
        if kind == "output":
            out[message.output.stream] += message.output.data
        elif kind == "exit":
            return bytes(out[1]), bytes(out[2]), message.exit
        elif kind == "end":  # the last chunks and the exit in one message
            for chunk in message.end.output:
                out[chunk.stream] += chunk.data
            return bytes(out[1]), bytes(out[2]), message.end.exit


async def test_commands_on_one_call_each_get_their_output_and_exit(node, sandbox):
    async with node.client.commands(sandbox.sandbox_id) as shell:
        first = await shell.run("echo one; echo err >&2; exit 3")
        second = await shell.run("echo two")
        binary = await shell.run(r"printf '\x00\xff'")
    assert (first.stdout, first.stderr, first.exit_code) == (b"one\n", b"err\n", 3)
    assert (second.stdout, second.exit_code) == (b"two\n", 0)
    assert binary.stdout == b"\x00\xff"


async def test_a_short_command_ends_with_its_output_and_exit_in_order(node, sandbox):
    # Whether the last chunks come as `output` messages or inside `end`, nothing is lost or
    # reordered, stderr included.
    call = node.stub.ExecCommands(timeout=RPC_TIMEOUT_S)
    for index in range(20):
        await call.write(_start(sandbox.sandbox_id, f"echo {index}; echo e{index} >&2; exit 4"))
        stdout, stderr, exit_ = await _read_command(call)
        assert (stdout, stderr) == (f"{index}\n".encode(), f"e{index}\n".encode())
        assert exit_.exit_code == 4
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def test_a_command_larger_than_a_pipe_buffer_arrives_whole(node, sandbox):
    # docs/shell-protocol.md: Framing (length, ANSI-C quoting), C3
    # The command line is framed by its length and may span many pipe writes; non-ASCII text
    # and quotes survive the quoting.
    payload = ("ab'c\\é\n" * 40_000)[:300_000]
    command = f"printf %s {shlex.quote(payload)} | sha256sum"
    async with node.client.commands(sandbox.sandbox_id) as shell:
        result = await shell.run(command)
        after = await shell.run("echo next")
    expected = hashlib.sha256(payload.encode()).hexdigest()
    assert result.stdout.split()[0].decode() == expected
    assert after.stdout == b"next\n"


async def test_commands_on_one_call_keep_isolated_and_session_modes(node, sandbox):
    async with node.client.commands(sandbox.sandbox_id) as shell:
        await shell.run("cd /etc; export FOO=bar")
        isolated = await shell.run('pwd; echo "${FOO-unset}"')
        await shell.run("cd /etc; export FOO=bar", session=True)
        session = await shell.run('pwd; echo "$FOO"', session=True)
    assert isolated.stdout == b"/tmp\nunset\n"
    assert session.stdout == b"/etc\nbar\n"


async def test_starts_sent_ahead_run_in_order(node, sandbox):
    # docs/shell-protocol.md: I1, N3
    call = node.stub.ExecCommands(timeout=RPC_TIMEOUT_S)
    for index in range(3):
        await call.write(_start(sandbox.sandbox_id, f"sleep 0.0{index}; echo {index}"))
    await call.done_writing()
    outputs = [(await _read_command(call))[0] for _ in range(3)]
    assert outputs == [b"0\n", b"1\n", b"2\n"]
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK


async def test_stdin_and_signals_go_to_the_running_command(node, sandbox):
    # docs/shell-protocol.md: N5, N11, Channels (stdin.<nonce>)
    call = node.stub.ExecCommands(timeout=RPC_TIMEOUT_S)
    await call.write(_start(sandbox.sandbox_id, "tr a-z A-Z", open_stdin=True))
    await call.write(pb.ExecCommandsRequest(stdin=pb.ExecStdin(data=b"abc", close=True)))
    stdout, _, exit_ = await _read_command(call)
    assert (stdout, exit_.exit_code) == (b"ABC", 0)

    await call.write(_start(sandbox.sandbox_id, "sleep 100", notify_started=True))
    started = await call.read()
    assert started.WhichOneof("kind") == "started"
    await call.write(pb.ExecCommandsRequest(signal=pb.ExecSignal(signal=pb.SIGNAL_INT)))
    _, _, exit_ = await _read_command(call)
    assert exit_.signaled and exit_.exit_code == 130
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def test_an_empty_command_ends_the_call_after_the_commands_before_it(node, sandbox):
    call = node.stub.ExecCommands(timeout=RPC_TIMEOUT_S)
    await call.write(_start(sandbox.sandbox_id, "echo before"))
    await call.write(_start(sandbox.sandbox_id, "   "))
    stdout, _, exit_ = await _read_command(call)
    assert (stdout, exit_.exit_code) == (b"before\n", 0)
    err = await rpc_error(call.read())
    assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, "EMPTY_COMMAND")


async def test_unknown_sandbox_ends_the_call_with_not_found(node):
    call = node.stub.ExecCommands(timeout=RPC_TIMEOUT_S)
    await call.write(_start("sbx-does-not-exist", "echo hi"))
    err = await rpc_error(call.read())
    assert_status(err, grpc.StatusCode.NOT_FOUND, "SANDBOX_NOT_FOUND")


async def test_stdin_for_a_command_without_open_stdin_ends_the_call(node, sandbox):
    call = node.stub.ExecCommands(timeout=RPC_TIMEOUT_S)
    await call.write(_start(sandbox.sandbox_id, "sleep 100", notify_started=True))
    assert (await call.read()).WhichOneof("kind") == "started"
    await call.write(pb.ExecCommandsRequest(stdin=pb.ExecStdin(data=b"x")))
    with_exit = await _read_command(call)  # the command is killed, like a cancelled one
    assert with_exit[2].exit_code == 137
    err = await rpc_error(call.read())
    assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, "STDIN_NOT_OPEN")
    after = await node.client.run(sandbox.sandbox_id, "echo still here")
    assert after.stdout == b"still here\n"


async def test_cancelling_the_call_kills_the_running_command(node, sandbox):
    # docs/shell-protocol.md: N12
    marker = "/tmp/survived"
    call = node.stub.ExecCommands(timeout=RPC_TIMEOUT_S)
    await call.write(_start(sandbox.sandbox_id, f"sleep 2; touch {marker}", notify_started=True))
    assert (await call.read()).WhichOneof("kind") == "started"
    call.cancel()
    await asyncio.sleep(3)
    check = await node.client.run(sandbox.sandbox_id, f"test -e {marker}; echo $?; ps -eo cmd")
    assert check.stdout.startswith(b"1\n")
    assert b"sleep 2" not in check.stdout


async def test_a_stream_that_failed_is_reopened_for_the_next_command(node, sandbox):
    async with node.client.commands(sandbox.sandbox_id) as shell:
        err = await rpc_error(shell.run("   "))
        assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, "EMPTY_COMMAND")
        after = await shell.run("echo again")
    assert after.stdout == b"again\n"


async def test_thousands_of_back_to_back_commands_never_lose_an_exit(node, sandbox):
    # docs/shell-protocol.md: C2, C3 (batons), C6, N7, N8
    sid = sandbox.sandbox_id
    async with node.client.commands(sid, deadline_s=300) as shell:
        for index in range(STRESS_COMMANDS):
            # Alternate a builtin (ends before the supervisor waits) and a forked program.
            command = f"echo {index}" if index % 2 else f"/bin/echo {index}"
            result = await asyncio.wait_for(shell.run(command), timeout=30)
            assert (result.stdout, result.exit_code) == (f"{index}\n".encode(), 0)
    # The same through one Exec call per command.
    for index in range(STRESS_COMMANDS // 4):
        result = await asyncio.wait_for(node.client.run(sid, f"echo {index}"), timeout=30)
        assert result.stdout == f"{index}\n".encode()


async def test_commands_need_the_lease_token_when_the_node_checks_them(node_factory, base_image):
    secret = "capability-secret"
    node = await node_factory(capability_secret=secret)
    sandbox = await node.create(base_image, workdir="/tmp")
    call = node.stub.ExecCommands(timeout=RPC_TIMEOUT_S)
    await call.write(_start(sandbox.sandbox_id, "echo hi"))
    assert_status(
        await rpc_error(call.read()), grpc.StatusCode.UNAUTHENTICATED, "LEASE_TOKEN_MISSING"
    )

    token = capability.mint(
        secret.encode(), lease_id="", sandbox_id=sandbox.sandbox_id, expire_time=time.time() + 60
    )
    metadata = ((capability.LEASE_TOKEN_METADATA_KEY, token),)
    async with node.client.commands(sandbox.sandbox_id, metadata=metadata) as shell:
        assert (await shell.run("echo hi")).stdout == b"hi\n"
    other = capability.mint(
        secret.encode(), lease_id="", sandbox_id="sbx-other", expire_time=time.time() + 60
    )
    async with node.client.commands(
        sandbox.sandbox_id, metadata=((capability.LEASE_TOKEN_METADATA_KEY, other),)
    ) as shell:
        err = await rpc_error(shell.run("echo hi"))
    assert_status(err, grpc.StatusCode.PERMISSION_DENIED, "LEASE_TOKEN_FOREIGN")
