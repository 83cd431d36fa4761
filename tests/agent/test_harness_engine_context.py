"""A harness episode whose model call the engine refuses as over its context length (through a
real gateway session over the replay's SGLang-shaped 400) ends LIMIT_CONTEXT, as swerl's own
loop does, whether the harness then fails or stops by itself; one that still submits a patch
is SUBMITTED. The harness here is a stand-in behind swerl's own Harness protocol that talks to
its session with the real `openai` SDK."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from testkit.gateway import KEY, gateway_env
from testkit.gateway_hostile import no_call_failed

from swerl.agent.harnesses import driving
from swerl.agent.harnesses.base import HarnessFailed, HarnessRun
from swerl.agent.harnesses.model import EpisodeModel
from swerl.agent.status import EpisodeStatus

LONG = f"{KEY}: " + "please read this long question " * 40


class _OneCallHarness:
    """Asks its model one over-long question, then does what `after` says."""

    name = "one-call"
    timeout_status = EpisodeStatus.HARNESS_TIMEOUT

    def __init__(self, after: str) -> None:
        self.after = after
        self.refusal: openai.BadRequestError | None = None

    async def prepare(self, run: HarnessRun) -> None:
        return None

    async def run(self, run: HarnessRun) -> str | None:
        assert run.model is not None
        async with openai.AsyncOpenAI(
            base_url=run.model.openai_base_url, api_key=run.model.api_key, max_retries=0
        ) as client:
            try:
                await client.chat.completions.create(
                    model=run.model.model, messages=[{"role": "user", "content": LONG}]
                )
            except openai.BadRequestError as err:
                self.refusal = err
        if self.after == "fail":
            raise HarnessFailed("the model refused the context; giving up")
        return "diff --git a/x b/x\n" if self.after == "submit" else None

    async def cancel(self) -> None:
        return None

    def log(self) -> bytes:
        return b""


@pytest.mark.parametrize(
    ("after", "status"),
    [
        ("fail", EpisodeStatus.LIMIT_CONTEXT),
        ("stop", EpisodeStatus.LIMIT_CONTEXT),
        ("submit", None),  # it submitted: the episode ends SUBMITTED on its patch
    ],
)
async def test_a_harness_refused_by_the_engines_context_ends_on_its_context_limit(
    after: str, status: EpisodeStatus | None
) -> None:
    harness = _OneCallHarness(after)
    with no_call_failed():
        async with gateway_env(context_length=64) as env:
            model = EpisodeModel(env.gateway, await env.open())
            run: Any = HarnessRun(
                spec=None,  # type: ignore[arg-type]  (the stand-in reads only its model)
                sandbox=None,  # type: ignore[arg-type]
                agent_loop=None,  # type: ignore[arg-type]
                model=model.model,
            )
            driven = await driving.drive(harness, run, model)
    assert harness.refusal is not None
    assert harness.refusal.body["code"] == "context_length_exceeded"
    assert driven.status is status
    if status is None:
        assert driven.submitted == "diff --git a/x b/x\n"
