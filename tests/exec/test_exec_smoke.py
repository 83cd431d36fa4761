from __future__ import annotations


async def test_echo_round_trip_through_grpc(node, sandbox):
    result = await node.client.run(sandbox.sandbox_id, "echo hi; echo err >&2; exit 3")
    assert result.stdout == b"hi\n"
    assert result.stderr == b"err\n"
    assert result.exit_code == 3
