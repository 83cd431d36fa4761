"""How a command's end reaches the node: the worker's early end marker W (sent as the command
ends, before the worker's teardown), the supervisor's E that always follows, and the marker
scanner that tells both from output that merely looks like them."""

from __future__ import annotations

import time

from swerl.exec.shell import MarkerScanner

TOKEN = "0123456789abcdef01234567"
END_ID = b"feedfacecafebeef"


def _scan(chunks: list[bytes], end_id: bytes = END_ID) -> list[tuple[bool, bytes]]:
    scanner = MarkerScanner(TOKEN)
    scanner.end_id = end_id
    out: list[tuple[bool, bytes]] = []
    for chunk in chunks:
        out.extend(scanner.feed(chunk))
    # Consecutive output pieces are one stream of bytes: join them to compare.
    merged: list[tuple[bool, bytes]] = []
    for is_marker, payload in out:
        if merged and not is_marker and not merged[-1][0]:
            merged[-1] = (False, merged[-1][1] + payload)
        else:
            merged.append((is_marker, payload))
    return merged


def test_scanner_finds_token_markers_and_the_current_end_marker():
    # docs/shell-protocol.md: Markers (S, W), I2
    data = b"out\0SWERL:" + TOKEN.encode() + b":S:42\0more\0SWERL:" + END_ID + b":W:3\0"
    assert _scan([data]) == [(False, b"out"), (True, b"S:42"), (False, b"more"), (True, b"W:3")]


def test_scanner_reassembles_markers_split_across_reads_at_every_byte():
    # docs/shell-protocol.md: Markers (E), I2
    data = b"ab\0SWERL:" + TOKEN.encode() + b":E:0\0cd"
    for cut in range(1, len(data)):
        assert _scan([data[:cut], data[cut:]]) == [
            (False, b"ab"),
            (True, b"E:0"),
            (False, b"cd"),
        ], cut


def test_scanner_passes_lookalikes_through_as_output_byte_for_byte():
    # docs/shell-protocol.md: Markers (foreign id, stale END_ID, E with END_ID, too long), I2
    foreign = b"\0SWERL:deadbeef:W:0\0"  # another id
    stale = b"\0SWERL:" + END_ID + b":W:0\0"  # an end id no command holds any more
    not_w = b"\0SWERL:" + END_ID + b":E:0\0"  # an end id may only carry W
    overlong = b"\0SWERL:" + b"x" * 300 + b"\0"
    for data in (foreign, not_w, overlong):
        assert _scan([b"a", data, b"b"]) == [(False, b"a" + data + b"b")]
    assert _scan([b"a", stale, b"b"], end_id=b"") == [(False, b"a" + stale + b"b")]


def test_scanner_finds_a_marker_right_after_a_lookalike():
    # docs/shell-protocol.md: Markers, I2
    data = b"\0SWERL:junk\0SWERL:" + TOKEN.encode() + b":E:5\0"
    assert _scan([data]) == [(False, b"\0SWERL:junk"), (True, b"E:5")]


async def test_exit_trap_output_of_a_command_comes_before_its_exit(node, sandbox):
    # docs/shell-protocol.md: C5 (a command's own EXIT trap), N7, I3
    async with node.client.commands(sandbox.sandbox_id) as shell:
        result = await shell.run("trap 'echo bye; echo bye-err >&2' EXIT; echo hi")
    assert (result.exit_code, result.stdout, result.stderr) == (0, b"hi\nbye\n", b"bye-err\n")


async def test_commands_that_leave_without_the_early_marker_still_report_their_exit(node, sandbox):
    # docs/shell-protocol.md: C5 (no W), C6, N7, I3
    # `exit`, errexit, a signal and a command that took stdout away end without W: the
    # supervisor's E reports them, and the next command on the same call is unaffected.
    async with node.client.commands(sandbox.sandbox_id) as shell:
        explicit = await shell.run("echo a; exit 3")
        errexit = await shell.run("set -e; false; echo unreachable")
        signaled = await shell.run("echo b; kill -TERM $BASHPID")
        redirected = await shell.run("exec >/dev/null; echo hidden; echo shown >&2")
        after = await shell.run("echo next")
    assert (explicit.exit_code, explicit.stdout) == (3, b"a\n")
    assert (errexit.exit_code, errexit.stdout) == (1, b"")
    assert (signaled.exit_code, signaled.stdout) == (143, b"b\n")
    assert (redirected.exit_code, redirected.stdout, redirected.stderr) == (0, b"", b"shown\n")
    assert (after.exit_code, after.stdout, after.stderr) == (0, b"next\n", b"")


async def test_a_command_ending_its_own_run_early_does_not_leak_into_the_next(node, sandbox):
    # docs/shell-protocol.md: N8, N9, I1, I2
    # A command can read its own end id (`trap -p`) and send W itself while it keeps running.
    # That ends only its own run: what it prints afterwards is dropped, and the next command
    # starts only once the supervisor reported the real end.
    forge = (
        "id=$(trap -p EXIT | sed -E 's/.*__swerl_exit ([0-9a-f]+).*/\\1/');"
        ' printf "early\\0SWERL:$id:W:7\\0"; sleep 1; echo late; echo late-err >&2'
    )
    async with node.client.commands(sandbox.sandbox_id) as shell:
        forged = await shell.run(forge, timeout_s=30)
        started = time.monotonic()
        after = await shell.run("echo next")
        waited_s = time.monotonic() - started
    assert (forged.exit_code, forged.stdout, forged.stderr) == (7, b"early", b"")
    assert (after.exit_code, after.stdout, after.stderr) == (0, b"next\n", b"")
    assert waited_s > 0.5, "the next command ran while the forging one was still running"


async def test_session_state_is_saved_before_the_next_command_starts(node, sandbox):
    # docs/shell-protocol.md: C5 (mode s), N8, I1
    # The SESSION save runs in the worker's exit trap, before its early end marker.
    async with node.client.commands(sandbox.sandbox_id) as shell:
        for index in range(30):
            result = await shell.run(
                f"[ ${{counter:-0}} = {index} ] || echo lost; counter={index + 1}", session=True
            )
            assert (result.exit_code, result.stdout) == (0, b""), index
