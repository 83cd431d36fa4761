"""What a command sees and what comes back: bytes, modes, env, cwd, stdin and signals."""

from __future__ import annotations

import asyncio
import hashlib

import grpc
import pytest
from testkit.exec import ExecStream, assert_status, rpc_error

from swerl.exec.client import exec_start
from swerl.exec.v1 import sandbox_pb2 as pb


async def test_binary_output_is_delivered_byte_for_byte(node, sandbox):
    # docs/shell-protocol.md: N4, I2
    sid = sandbox.sandbox_id
    small = await node.client.run(sid, r"printf '\x00\x01\xff\xfe'")
    assert small.stdout == b"\x00\x01\xff\xfe"

    on_stderr = await node.client.run(sid, r"printf '\xff\x00\xc3(' >&2")
    assert (on_stderr.stdout, on_stderr.stderr) == (b"", b"\xff\x00\xc3(")

    # Text shaped like the node's own framing is just output (it carries another nonce).
    forged = await node.client.run(sid, r"printf '\0SWERL:0123456789abcdef:E:0\0after'")
    assert forged.stdout == b"\0SWERL:0123456789abcdef:E:0\0after"
    assert forged.exit_code == 0

    # tee's copy goes to stdout while sha256sum digests the same bytes inside the container.
    digest = await node.client.run(sid, "head -c 65536 /dev/urandom | tee /tmp/r | sha256sum")
    received = await node.client.run(sid, "cat /tmp/r")
    assert len(received.stdout) == 65536
    assert digest.stdout.split()[0].decode() == hashlib.sha256(received.stdout).hexdigest()
    # The same, in one command, with the raw bytes on stderr.
    both = await node.client.run(sid, "head -c 65536 /dev/urandom | tee /dev/stderr | sha256sum")
    assert len(both.stderr) == 65536
    assert both.stdout.split()[0].decode() == hashlib.sha256(both.stderr).hexdigest()


async def test_isolated_commands_do_not_keep_cd_exports_or_functions(node, sandbox):
    # docs/shell-protocol.md: C4 (mode i), I5
    sid = sandbox.sandbox_id
    await node.client.run(sid, "cd /etc; export FOO=bar; greet() { echo hi; }")
    result = await node.client.run(
        sid, 'pwd; echo "FOO=${FOO-unset}"; type greet >/dev/null 2>&1 || echo no-greet'
    )
    assert result.stdout == b"/tmp\nFOO=unset\nno-greet\n"


async def test_session_commands_keep_cd_exports_and_functions(node, sandbox):
    # docs/shell-protocol.md: C4, C5 (mode s)
    sid = sandbox.sandbox_id
    setup = await node.client.run(
        sid, "cd /etc; export FOO=bar; LOCAL=x; greet() { echo hi; }", session=True
    )
    assert setup.exit_code == 0
    for _ in range(3):  # the state carries over every hop, not just the first
        result = await node.client.run(sid, 'pwd; echo "$FOO $LOCAL"; greet', session=True)
        assert result.stdout == b"/etc\nbar x\nhi\n"


async def test_isolated_command_neither_sees_nor_disturbs_the_session(node, sandbox):
    # docs/shell-protocol.md: C4, C5, I5
    sid = sandbox.sandbox_id
    await node.client.run(sid, "cd /etc; export FOO=bar", session=True)
    isolated = await node.client.run(sid, 'pwd; echo "${FOO-unset}"; cd /usr; export FOO=z')
    assert isolated.stdout == b"/tmp\nunset\n"
    resumed = await node.client.run(sid, 'pwd; echo "$FOO"', session=True)
    assert resumed.stdout == b"/etc\nbar\n"


async def test_per_command_env_and_cwd_apply_to_that_command_only(node, sandbox):
    # docs/shell-protocol.md: Framing (CWD, ENV_SCRIPT), C4, I5
    sid = sandbox.sandbox_id
    env = {"PLAIN": "1", "TRICKY": "two words 'quoted' $HOME\nsecond line\\"}
    result = await node.client.run(
        sid, 'pwd; printf "%s|%s" "$PLAIN" "$TRICKY"', cwd="/usr", env=env
    )
    assert result.exit_code == 0
    assert result.stdout == b"/usr\n1|" + env["TRICKY"].encode()
    after = await node.client.run(sid, 'pwd; echo "${PLAIN-unset}"')
    assert after.stdout == b"/tmp\nunset\n"


@pytest.mark.parametrize("session", [False, True], ids=["isolated", "session"])
async def test_missing_cwd_fails_the_call_with_a_reason_and_the_sandbox_keeps_working(
    node, sandbox, session
):
    # docs/shell-protocol.md: C4 (D for a cwd it cannot enter), N15
    for cwd in ("/does/not/exist", "/etc/hostname"):  # absent, and a file
        err = await rpc_error(
            node.client.run(sandbox.sandbox_id, "echo never", cwd=cwd, session=session)
        )
        metadata = assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, "CWD_NOT_FOUND")
        assert metadata["cwd"] == cwd
        # The reason speaks of the caller's cwd, not of the node's shell machinery.
        assert cwd in err.details()
        assert "line" not in err.details() and "swerl" not in err.details()
    after = await node.client.run(sandbox.sandbox_id, "echo ok; pwd", session=session)
    assert (after.exit_code, after.stdout) == (0, b"ok\n/tmp\n")


async def test_sandbox_env_reaches_every_command(node, base_image):
    # docs/shell-protocol.md: C1 (the node's env exports)
    sandbox = await node.create(base_image, env={"SBX_NAME": "alpha beta"})
    for _ in range(2):
        result = await node.client.run(sandbox.sandbox_id, 'echo "$SBX_NAME"')
        assert result.stdout == b"alpha beta\n"


async def test_stdin_messages_feed_the_command_until_closed(node, sandbox):
    # docs/shell-protocol.md: Channels (stdin.<nonce>), C4
    stream = ExecStream(node.stub, exec_start(sandbox.sandbox_id, "tr a-z A-Z", open_stdin=True))
    stream.send_stdin(b"hello ")
    stream.send_stdin(b"binary \x00\xff ")
    stream.send_stdin(b"world\n", close=True)
    result = await asyncio.wait_for(stream.result(), 30)
    assert result.exit_code == 0
    assert result.stdout == b"HELLO BINARY \x00\xff WORLD\n"


async def test_stdin_is_empty_unless_opened(node, sandbox):
    # docs/shell-protocol.md: C4 (stdin from /dev/null)
    result = await node.client.run(sandbox.sandbox_id, "cat; echo done", timeout_s=10)
    assert (result.stdout, result.timed_out) == (b"done\n", False)


async def test_interrupt_signal_ends_the_command_and_is_reported(node, sandbox):
    # docs/shell-protocol.md: N5, N11
    stream = ExecStream(node.stub, exec_start(sandbox.sandbox_id, "sleep 100", notify_started=True))
    await stream.started()
    stream.send_signal(pb.SIGNAL_INT)
    result = await asyncio.wait_for(stream.result(), 10)
    assert result.signaled
    assert not result.timed_out
    assert result.exit_code == 130
    after = await node.client.run(sandbox.sandbox_id, "echo ok")
    assert after.stdout == b"ok\n"


async def test_commands_on_one_sandbox_run_one_at_a_time_in_arrival_order(node, sandbox):
    # docs/shell-protocol.md: I1, "the turn"
    sid = sandbox.sandbox_id
    first = asyncio.ensure_future(node.client.run(sid, "sleep 0.5; echo a >> /tmp/order"))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(node.client.run(sid, "echo b >> /tmp/order"))
    await asyncio.gather(first, second)
    order = await node.client.run(sid, "cat /tmp/order")
    assert order.stdout == b"a\nb\n"
