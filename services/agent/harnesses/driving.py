"""Driving a harness through an episode: its prepare and run in the sandbox, watched by the
episode's gateway session when the harness talks to one, and how the run ended.

A harness's failure ends the episode HARNESS_FAILED (the sandbox is graded as it stands), or
LIMIT_CONTEXT when it failed, or stopped without submitting, on a context its session refused
(the session's budget, or the engine's own context length; as swerl's own loop ends); a
trainer abort seen by the session ends it ABORTED. A run that ends by itself hands back what
it submitted; the episode decides whether that ends it SUBMITTED.
"""

from __future__ import annotations

from dataclasses import dataclass

from swerl.agent.harnesses.base import Harness, HarnessFailed, HarnessRun
from swerl.agent.harnesses.model import EpisodeModel, PolicyAborted
from swerl.agent.status import EpisodeStatus


@dataclass(frozen=True)
class Driven:
    """How a harness's run ended: an ending status (with its reason and detail), or none and
    what it submitted."""

    status: EpisodeStatus | None = None
    reason: str = ""
    detail: str = ""
    submitted: str | None = None


async def drive(harness: Harness, run: HarnessRun, model: EpisodeModel | None) -> Driven:
    """Prepares and runs `harness`; `model` is the episode's gateway session (None for swerl's
    own loop), which watches the run: a policy that is down or a gateway that went away raise
    from it (INFRA_ERROR), a trainer abort ends the run ABORTED."""
    try:
        if model is None:
            submitted = await _prepare_and_run(harness, run)
        else:
            submitted = await model.guard(_prepare_and_run(harness, run))
    except HarnessFailed as err:
        if model is not None and model.context_exhausted:
            return Driven(EpisodeStatus.LIMIT_CONTEXT, "", err.detail)
        return Driven(EpisodeStatus.HARNESS_FAILED, err.reason, err.detail)
    except PolicyAborted as err:
        return Driven(EpisodeStatus.ABORTED, "POLICY_ABORTED", str(err))
    if submitted is None and model is not None and model.context_exhausted:
        # It gave up without submitting once its context was refused (by the session's
        # budget or by the engine itself): the episode's context limit, as swerl's loop ends.
        return Driven(EpisodeStatus.LIMIT_CONTEXT, "", "the harness stopped on its context limit")
    return Driven(submitted=submitted)


async def _prepare_and_run(harness: Harness, run: HarnessRun) -> str | None:
    await harness.prepare(run)
    return await harness.run(run)
