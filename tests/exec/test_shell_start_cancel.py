"""A sandbox destroyed while its shell is starting leaves no thread blocked on its FIFOs.

docs/shell-protocol.md: N1 (a supervisor is started on the command's turn). The FIFO opens of a
starting shell run on the loop's default executor; when every worker is busy they are queued,
and a destroy (cancel) that arrives before they run must still let each of them return. Before
the fix a queued open ran after the cancel had already opened and closed its peer, blocked for
good on a FIFO whose directory was then removed, and a node lost a worker per such destroy
(found by the branching tests: three forks released while their shells started).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import pytest

from swerl.exec.docker_backend import DockerBackend
from swerl.exec.shell import Supervisor, supervisor
from swerl.exec.shell.wire import CONTAINER_IO_DIR

WORKERS = 2


GENERATION = 900_000  # the start-up's FIFO names: in.900000, out.900000, ...


@pytest.fixture
def idle_container(base_image, tmp_path: Path, monkeypatch):
    client = docker.from_env()
    # The container's I/O directory is a decoy, not the node's: its in-FIFO has no writer, so
    # the shell the supervisor execs stays alive, blocked opening it, and never opens the
    # node's FIFOs. The start-up waits on them until it is cancelled, as with a destroyed
    # sandbox (a shell that died instead would be seen by the start-up's watch).
    monkeypatch.setattr(supervisor, "_generation", itertools.count(GENERATION))
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    os.mkfifo(decoy / f"in.{GENERATION}")
    container = client.containers.run(
        base_image,
        ["sleep", "300"],
        detach=True,
        labels={"swerl.test": "shell-start-cancel"},
        volumes={str(decoy): {"bind": CONTAINER_IO_DIR, "mode": "rw"}},
    )
    try:
        yield container.id
    finally:
        container.remove(force=True)
        client.close()


async def test_a_shell_start_cancelled_while_its_fifo_opens_wait_for_a_worker_frees_them(
    idle_container, tmp_path: Path
):
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="test-default")
    loop.set_default_executor(executor)
    backend = DockerBackend.from_env(threads=4)
    gate = threading.Event()
    try:
        # Every default worker busy: the start-up's three FIFO opens are queued behind them.
        busy = [loop.run_in_executor(None, gate.wait) for _ in range(WORKERS)]
        io_dir = tmp_path / "io"
        io_dir.mkdir()
        start = asyncio.ensure_future(Supervisor.start(backend, idle_container, io_dir, {}))
        await asyncio.sleep(0.5)  # the exec of the shell went out; the opens still wait
        assert not start.done()
        start.cancel()  # the sandbox is destroyed during the start-up
        await asyncio.sleep(0.2)
        gate.set()  # the workers free up: the queued opens run only now
        await asyncio.gather(*busy)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(start), 10)
        # Nothing is left blocked on the executor: it shuts down at once.
        shut = threading.Thread(target=executor.shutdown, kwargs={"wait": True}, daemon=True)
        shut.start()
        for _ in range(100):  # polled: the default executor is the one shutting down
            if not shut.is_alive():
                break
            await asyncio.sleep(0.1)
        assert not shut.is_alive(), "a FIFO open is still blocked on a default-executor worker"
    finally:
        gate.set()
        backend.close()
