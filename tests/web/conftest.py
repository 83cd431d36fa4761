"""Fixtures of the browser tests: real runs produced by real episodes (replay policy with the real
Qwen3 tokenizer, pool + exec node + agent on the real dockerd), Debian's chromium driven through
selenium and its chromedriver, and a folder for the screenshots the tests save."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from swerl.agent.replay import ReplayPolicyServer, scripts_for_tasks
from swerl.agent.server import local_agent
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import make_channel
from swerl.stack import local_stack
from swerl.tasks import build_images, default_tasks_dir, load_tasks

# web_testkit sits beside this file; a plain `conftest` import would be ambiguous across test
# folders, so helpers live in a module with a unique name.
sys.path.insert(0, str(Path(__file__).parent))
from web_testkit import run_episode, start_message

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
# The tasks that get a wrong patch (reward -1) in the generated run; all get a gold one.
WRONG = 2


async def _produce(run_dir: Path, dynamic_dir: Path, trimmed_dir: Path) -> None:
    tasks = load_tasks(default_tasks_dir())
    gold = ReplayPolicyServer(scripts_for_tasks(tasks, "gold"))
    wrong = ReplayPolicyServer(scripts_for_tasks(tasks[:WRONG], "wrong"))
    # Twelve long outputs in a 4,096-token window: the context is trimmed on the way.
    key = next(iter(scripts_for_tasks(tasks[:1])))
    looks = ReplayPolicyServer(
        {key: [f"Looking.\n\n```bash\nseq {i} {i + 150}\n```" for i in range(12)]}
    )
    gold_url, wrong_url, looks_url = await gold.start(), await wrong.start(), await looks.start()
    try:
        async with local_stack(nodes=1, max_sandboxes=6, purpose="web-test") as stack:
            async with local_agent(stack.pool_address, stack.token, tokenizer_processes=0) as agent:
                channel = make_channel(agent.address, token=stack.token)
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                starts = [
                    start_message(t, gold_url, f"gold-{i}", str(run_dir))
                    for i, t in enumerate(tasks)
                ]
                starts += [
                    start_message(t, wrong_url, f"wrong-{i}", str(run_dir))
                    for i, t in enumerate(tasks[:WRONG])
                ]
                starts.append(
                    start_message(tasks[0], gold_url, "dynamic-0", str(dynamic_dir), dynamic=True)
                )
                for dynamic in (False, True):
                    trimmed = start_message(
                        tasks[0],
                        looks_url,
                        f"trim-{int(dynamic)}",
                        str(trimmed_dir),
                        dynamic=dynamic,
                    )
                    trimmed.limits.max_turns = 12
                    trimmed.limits.max_context_tokens = 4096
                    trimmed.limits.max_new_tokens = 512
                    starts.append(trimmed)
                limit = asyncio.Semaphore(4)

                async def one(start: pb.EpisodeStart) -> pb.EpisodeResult:
                    async with limit:
                        return await run_episode(stub, start)

                results = await asyncio.gather(*(one(s) for s in starts))
                await channel.close()
    finally:
        await gold.stop()
        await wrong.stop()
        await looks.stop()
    failed = [
        (r.episode_id, r.error_reason, r.error_message)
        for r in results
        if r.status
        != (
            pb.EPISODE_STATUS_LIMIT_TURNS
            if r.episode_id.startswith("trim-")
            else pb.EPISODE_STATUS_SUBMITTED
        )
        or not r.artifact_dir
    ]
    assert not failed, failed
    # tokens.json holds the result's token records as they are
    for result in results:
        written = json.loads((Path(result.artifact_dir) / "tokens.json").read_text())
        records = [result.trajectory] if result.HasField("trajectory") else list(result.turns)
        stored = [written["trajectory"]] if written["trajectory"] else written["turns"]
        assert len(stored) == len(records)
        for record, saved in zip(records, stored, strict=True):
            assert saved["prompt_ids"] == list(record.prompt_ids)
            assert saved["response_ids"] == list(record.response_ids)
            assert saved["loss_mask"] == list(record.loss_mask)
            assert saved["logprobs"] == pytest.approx(list(record.logprobs), abs=1e-4)


@pytest.fixture(scope="session")
def real_run() -> Iterator[tuple[Path, Path]]:
    """(an agent artifact directory of 8 real episodes: 6 gold, 2 wrong; a directory with one
    dynamic-history episode). A third directory, `trimmed_run`, holds two episodes whose context
    was trimmed (one whole-episode record, one dynamic history)."""
    tasks = load_tasks(default_tasks_dir())
    base = os.environ.get("SWERL_BASE_IMAGE", "swerl-base:bookworm")
    build_images(tasks, base_image=base, progress=lambda line: None)
    with tempfile.TemporaryDirectory(prefix="swerl-web-run-") as root:
        run_dir, dynamic_dir = Path(root) / "run", Path(root) / "dynamic"
        asyncio.run(_produce(run_dir, dynamic_dir, Path(root) / "trimmed"))
        yield run_dir, dynamic_dir


@pytest.fixture(scope="session")
def trimmed_run(real_run) -> Path:
    return real_run[0].parent / "trimmed"


@pytest.fixture(scope="session")
def screenshots() -> Path:
    """Where the tests save their screenshots (kept after the run, for people to look at)."""
    folder = Path(
        os.environ.get("SWERL_TEST_ARTIFACTS", Path(tempfile.gettempdir()) / "swerl-test-artifacts")
    )
    folder = folder / "web"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="swerl-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
