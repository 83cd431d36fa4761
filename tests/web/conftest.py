"""Fixtures of the browser tests: real runs produced by real episodes (replay policy with the real
Qwen3 tokenizer, pool + exec node + agent on the real dockerd: testkit.web_runs),
Debian's chromium driven through selenium and its chromedriver, and a folder for the screenshots
the tests save."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from testkit.web_runs import CHROMEDRIVER, CHROMIUM, produce_runs

from swerl.tasks import build_images, default_tasks_dir, load_tasks


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
        asyncio.run(produce_runs(run_dir, dynamic_dir, Path(root) / "trimmed"))
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
