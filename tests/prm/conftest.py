"""Fixtures of the PRM tests: the scripted judge model server and the PRM service, both real
servers on port 0 in the test's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from testkit.prm import RunningPrm, build_judge_tokenizer, prm_settings, start_prm, stop_prm

from swerl.chassis.hf import bundled_qwen3_tokenizer_dir
from swerl.devservers.scripted_prm import ScriptedJudge


@pytest.fixture(scope="session")
def policy_tokenizer_dir() -> Path:
    return bundled_qwen3_tokenizer_dir()


@pytest.fixture(scope="session")
def judge_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_judge_tokenizer(tmp_path_factory.mktemp("judge-tokenizer"))


@pytest.fixture
async def scripted(
    judge_tokenizer_dir: Path,
) -> AsyncIterator[Callable[..., Awaitable[ScriptedJudge]]]:
    """Starts scripted judge servers (decoding with the judge tokenizer); stops them after."""
    started: list[ScriptedJudge] = []

    async def start(**kwargs: Any) -> ScriptedJudge:
        kwargs.setdefault("tokenizer_path", judge_tokenizer_dir)
        judge = ScriptedJudge(**kwargs)
        await judge.start()
        started.append(judge)
        return judge

    yield start
    for judge in started:
        await judge.stop()


@pytest.fixture
async def prm(judge_tokenizer_dir: Path) -> AsyncIterator[Callable[..., Awaitable[RunningPrm]]]:
    """Starts PRM services judging through `judge_url` with the judge tokenizer by default."""
    started: list[RunningPrm] = []

    async def start(judge_url: str, **overrides: Any) -> RunningPrm:
        tokenizer = overrides.pop("judge_tokenizer_path", judge_tokenizer_dir)
        running = await start_prm(prm_settings(judge_url, tokenizer, **overrides))
        started.append(running)
        return running

    yield start
    for running in started:
        await stop_prm(running)
