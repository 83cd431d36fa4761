"""Routing you can rely on (issue 23 item 10): the real SGLang router from PyPI (sglang-router,
its Rust binary `smg`) in front of two replay workers, with the policy that honours
`X-SMG-Routing-Key`, keeps every turn of an episode on one worker (so that worker's prefix
cache holds the episode's context). The agent's policy client sends the episode id as the key
(services/agent/loop/runner.py); here the real SglangPolicy sends it per episode.

sglang-router 0.3.2 (PyPI) names the key-honouring policy `manual`; slime's own build of the
router (build_conda.sh:149) adds `consistent_hashing`, which slime's rollout pairs with the same
header (slime rollout/sglang_rollout.py:196-200). Both route by the key."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import sys
from array import array
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from swerl.agent.policy.clients import SglangPolicy
from swerl.devservers.replay import ReplayPolicyServer

HEADER = "X-SMG-Routing-Key"
EPISODES = 16
TURNS = 3


def _smg() -> str:
    found = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    assert Path(found).exists(), "sglang-router's smg binary (pip install -e .[dev])"
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(log: Path) -> str:
    return log.read_text()[-2000:]


@contextlib.asynccontextmanager
async def router(worker_urls: list[str], policy: str, log: Path) -> AsyncIterator[str]:
    port = _free_port()
    args = ["launch", "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    with log.open("w") as out:
        proc = await asyncio.create_subprocess_exec(
            _smg(), *args, "--worker-urls", *worker_urls, stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            # The router answers /health before it has added its workers (it adds them in the
            # background, "Router ready | workers: []"): a request sent then goes to the one
            # worker added so far, so this waits until /workers lists every worker healthy.
            for _ in range(150):
                assert proc.returncode is None, await asyncio.to_thread(_tail, log)
                with contextlib.suppress(aiohttp.ClientError, ValueError):
                    async with session.get(url + "/workers") as reply:
                        listed = (await reply.json()).get("workers", [])
                        healthy = {w.get("url") for w in listed if w.get("is_healthy")}
                        if reply.status == 200 and healthy == set(worker_urls):
                            break
                await asyncio.sleep(0.2)
            else:
                raise AssertionError(
                    "router did not come up with every worker: "
                    + await asyncio.to_thread(_tail, log)
                )
        yield url
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)


async def test_every_turn_of_an_episode_reaches_one_worker_through_the_real_router(
    tmp_path: Path,
) -> None:
    workers = [ReplayPolicyServer(garbage=True) for _ in range(2)]
    urls = [await w.start() for w in workers]
    try:
        async with router(urls, "manual", tmp_path / "router.log") as url:
            async with aiohttp.ClientSession() as session:

                async def episode(i: int) -> None:
                    policy = SglangPolicy(
                        session, url, {}, request_timeout_s=30, headers={HEADER: f"ep-{i}"}
                    )
                    prompt = array("i", [11, 12, 13, i])
                    for _ in range(TURNS):
                        gen = await policy.generate(prompt, 8)
                        prompt = array("i", [*prompt, *gen.output_ids, 14])

                await asyncio.gather(*(episode(i) for i in range(EPISODES)))
    finally:
        for w in workers:
            await w.stop()
    where: dict[str, set[int]] = {}
    for index, worker in enumerate(workers):
        for call in worker.stats.calls:
            key = {k.lower(): v for k, v in call.headers.items()}[HEADER.lower()]
            where.setdefault(key, set()).add(index)
    assert sum(len(w.stats.calls) for w in workers) == EPISODES * TURNS
    assert sorted(where) == sorted(f"ep-{i}" for i in range(EPISODES))
    assert all(len(found) == 1 for found in where.values()), where
    # The keys were spread over both workers (16 keys all on one: odds 2 in 65536).
    assert all(w.stats.calls for w in workers)
