"""A Docker call whose caller is cancelled runs on in its thread (a blocking docker-py call cannot
be stopped); when it then fails, nobody is left to report it, and asyncio must not log "Future
exception was never retrieved" into whatever runs next (it landed in another test's stderr, and in
a node's log after a dockerd restart)."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from swerl.exec.docker_backend import DockerBackend


@pytest.mark.docker  # a real DockerBackend: its client connects to dockerd
async def test_a_cancelled_docker_call_that_fails_later_logs_nothing() -> None:
    backend = DockerBackend.from_env(threads=2)
    release = threading.Event()
    unhandled: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))

    def fails_later() -> None:
        release.wait(10)
        raise RuntimeError("docker said no, after its caller left")

    try:
        call = asyncio.ensure_future(backend.run_blocking(fails_later))
        await asyncio.sleep(0.05)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        del call
        release.set()
        await asyncio.sleep(0.2)  # the thread ends and its future is resolved on the loop
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0.05)
    finally:
        loop.set_exception_handler(None)
        backend.close()
    assert unhandled == []
