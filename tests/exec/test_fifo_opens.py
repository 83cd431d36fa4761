"""The node opens its FIFO ends (a shell's stdio, a command's stdin) on daemon threads of their
own (`swerl.exec.shell.wire.open_fifo_end`): an open that never meets its peer, because the
shell or the container died first, must hold up neither the event loop's shutdown (a closing
loop joins the default executor's threads, and one blocked open hung the node's exit and a
test's teardown for good) nor leak the descriptor when its peer comes after nobody wants it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path

from swerl.exec.shell.wire import make_fifo, open_fifo_end, unblock_fifo


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _fds_on(path: Path) -> set[str]:
    """This process's descriptors open on `path`, by what they point at: a descriptor number
    says nothing alone, since the worker's other threads open and close their own meanwhile
    (one closed between two listings and reused by the test's own open hid it: CI, 7 Dec)."""
    found = set()
    for fd in _open_fds():
        with contextlib.suppress(OSError):  # one closed as the listing was read
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                found.add(fd)
    return found


def _fds_on_after_settling(path: Path, allowed: set[str]) -> set[str]:
    """The descriptors on `path`, once those beyond `allowed` are gone (5 s at most: a late
    open's thread closes what it got)."""
    deadline = time.monotonic() + 5
    while _fds_on(path) - allowed and time.monotonic() < deadline:
        time.sleep(0.02)
    return _fds_on(path)


def test_an_open_that_never_meets_its_peer_does_not_hold_up_the_loops_shutdown(tmp_path) -> None:
    fifo = tmp_path / "out.1"
    make_fifo(fifo)

    async def main() -> None:
        opening = open_fifo_end(fifo, os.O_RDONLY)
        await asyncio.sleep(0.05)
        assert not opening.done()

    runner = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    runner.start()
    runner.join(10)
    hung = runner.is_alive()
    unblock_fifo(fifo)  # the peer comes after the loop closed (and frees a hung run, if any)
    runner.join(10)
    assert not hung, "the loop's shutdown waited on the FIFO open"
    assert _fds_on_after_settling(fifo, set()) == set(), "the late descriptor was not closed"


async def test_a_cancelled_open_closes_what_it_opens_and_a_wanted_one_delivers_it(tmp_path) -> None:
    fifo = tmp_path / "stdin.1"
    make_fifo(fifo)
    abandoned = open_fifo_end(fifo, os.O_WRONLY)
    await asyncio.sleep(0.05)
    abandoned.cancel()
    peer = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        settled = await asyncio.to_thread(_fds_on_after_settling, fifo, {str(peer)})
        assert settled == {str(peer)}, "the abandoned open's descriptor leaked"
        wanted = await asyncio.wait_for(open_fifo_end(fifo, os.O_WRONLY), 5)
        assert os.write(wanted, b"x") == 1 and os.read(peer, 1) == b"x"
        os.close(wanted)
    finally:
        os.close(peer)
    missing = open_fifo_end(tmp_path / "gone", os.O_RDONLY)
    try:
        await asyncio.wait_for(missing, 5)
    except FileNotFoundError:
        pass
    else:
        raise AssertionError("an open of a missing FIFO must fail")


async def test_ending_a_shells_opens_returns_when_a_fifo_was_removed_under_its_open(
    tmp_path,
) -> None:
    """A sandbox destroyed while its shell starts removes its I/O dir: an open already blocked
    on a FIFO whose name is gone can meet no peer, and ending the opens must not wait for it
    (it hung `swerl eval`'s exit after Ctrl-C)."""
    from swerl.exec.shell.supervisor import _close_opens

    names = {"out": tmp_path / "out.1", "err": tmp_path / "err.1"}
    for path in names.values():
        make_fifo(path)
    before = _open_fds()
    opens = {key: open_fifo_end(path, os.O_RDONLY) for key, path in names.items()}
    await asyncio.sleep(0.1)  # both threads are blocked in open(2) by now
    names["out"].unlink()  # the I/O dir goes with the sandbox
    began = time.monotonic()
    await asyncio.wait_for(_close_opens(opens, names), 10)
    assert time.monotonic() - began < 2, "ending the opens waited for one that cannot return"
    assert opens["out"].cancelled()
    assert opens["err"].done() and not opens["err"].cancelled()
    still_open = []
    for fd in _open_fds() - before:
        with contextlib.suppress(OSError):  # (the listing's own descriptor is gone by now)
            still_open.append(os.readlink(f"/proc/self/fd/{fd}"))
    assert not [target for target in still_open if "err.1" in target], "the open's fd leaked"
