"""Bounded reads through the real E2B SDK: a process's output is read back in reports that fit
the node's output cap of one command (which would drop the middle of a larger one), and a file
download whose file shrinks, is rewritten or grows while it is sent ends cleanly with bytes the
file really held, in order."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pytest
from e2b import CommandExitException, Sandbox
from testkit.e2b import Face, running_face

from swerl.e2b import files

pytestmark = pytest.mark.docker

# The node's output cap of each of the face's commands: far below what the commands print.
SMALL_OUTPUT_CAP = 64 << 10
BIG_BYTES = 600_000


@pytest.fixture(scope="module")
def small_face(base_image: str) -> Iterator[Face]:
    with running_face(base_image, max_output_bytes=SMALL_OUTPUT_CAP) as running:
        yield running


def _big_file(sandbox: Sandbox) -> str:
    """A text file of about BIG_BYTES in the sandbox; its exact content."""
    sandbox.commands.run(f"head -c {BIG_BYTES * 3 // 4} /dev/urandom | base64 -w 100 >/tmp/big")
    return sandbox.files.read("/tmp/big")


def test_output_far_above_one_reports_cap_comes_back_exact(small_face: Face, base_image: str):
    sandbox = Sandbox.create(base_image, timeout=120, **small_face.opts)
    try:
        # Read back inline with bash builtins: every byte, NULs included.
        assert sandbox.commands.run("printf 'a\\0b\\0\\0c\\n'").stdout == "a\0b\0\0c\n"
        big = _big_file(sandbox)
        assert len(big) > 8 * SMALL_OUTPUT_CAP
        # A quick foreground command: more than its launch reads inline, read on by polls.
        result = sandbox.commands.run("cat /tmp/big; echo done >&2")
        assert (result.stdout, result.stderr) == (big, "done\n")
        # A burst after the launch's grace, on both streams: many capped polls, then the end.
        burst = sandbox.commands.run(
            "sleep 0.5; cat /tmp/big; cat /tmp/big >&2; exit 3", background=True
        )
        with pytest.raises(CommandExitException) as exited:
            burst.wait()
        assert (exited.value.exit_code, exited.value.error) == (3, "exit status 3")
        assert (
            hashlib.sha256(exited.value.stdout.encode()).digest()
            == hashlib.sha256(big.encode()).digest()
        )
        assert exited.value.stderr == big
        # A kill while a large output is unread: what it wrote before the kill, exact.
        killed = sandbox.commands.run("cat /tmp/big; sleep 60", background=True)
        time.sleep(1.0)
        assert killed.kill() is True
        with pytest.raises(CommandExitException) as ended:
            killed.wait()
        assert (ended.value.exit_code, ended.value.error, ended.value.stdout) == (
            -1,
            "signal: killed",
            big,
        )
    finally:
        sandbox.kill()
    small_face.assert_nothing_left()


def test_a_download_of_a_file_rewritten_meanwhile_ends_with_bytes_it_held(
    face: Face, base_image: str, monkeypatch: pytest.MonkeyPatch
):
    # Small segments, so one download takes many Exec calls while the file changes under it.
    monkeypatch.setattr(files, "READ_SEGMENT_BYTES", 16 << 10)
    sandbox = Sandbox.create(base_image, timeout=120, **face.opts)
    try:
        source = bytes(range(256)) * 2048  # 512 KiB, each offset's byte known
        sandbox.files.write("/tmp/source", source)
        sandbox.files.write("/tmp/moving", source)
        # Truncated and written again, over and over: a download sees it shrink and grow.
        rewriter = sandbox.commands.run(
            "while :; do cat /tmp/source >/tmp/moving; done", background=True
        )
        for _ in range(8):
            body = bytes(sandbox.files.read("/tmp/moving", format="bytes", request_timeout=30))
            assert body == source[: len(body)]
        rewriter.kill()

        # Growing: appended numbered lines; a download is an exact prefix of the sequence.
        grower = sandbox.commands.run(
            "i=0; while :; do i=$((i+1)); printf 'line%07d\\n' $i; done >/tmp/growing",
            background=True,
        )
        time.sleep(0.5)
        body = bytes(sandbox.files.read("/tmp/growing", format="bytes", request_timeout=30))
        grower.kill()
        expected = b"".join(b"line%07d\n" % i for i in range(1, len(body) // 12 + 2))
        assert len(body) > 16 << 10
        assert body == expected[: len(body)]
    finally:
        sandbox.kill()
    face.assert_nothing_left()
