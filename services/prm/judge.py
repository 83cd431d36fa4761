"""The PRM judge: m concurrent votes on one agent step, averaged into a step score.

Each vote is one call to the judge model with its own seed (derived from episode, step and vote).
All calls of the service, whatever judgment they belong to, share one concurrency limit; each
call has a timeout; a call that cannot reach the judge's server is retried with the chassis
retry policy, a call that timed out or got an HTTP error is not (the model may still be working
on it, and sending it again would only add load). A vote that failed is an invalid vote with its
error; a judgment whose every vote failed is FAILED, never an exception, so the caller always
gets a verdict for the step.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from swerl.chassis.bounded import within
from swerl.chassis.retry import async_retrying
from swerl.prm import metrics
from swerl.prm.backends import JudgeBackend, RenderedPrompt
from swerl.prm.errors import (
    InvalidStepIndex,
    JudgeCallError,
    JudgeConnectionError,
    JudgeTimeout,
    MissingEpisodeId,
    MissingIssue,
    MissingStepResponse,
    PromptTooLong,
    VotesOutOfRange,
)
from swerl.prm.prompt import PromptLimits, StepToJudge, build_messages
from swerl.prm.votes import Verdict, Vote, parse_verdict, tally, vote_seed

# How often a prompt over the token budget is rebuilt with halved limits before giving up.
_PROMPT_SHRINK_ROUNDS = 4


@dataclass(frozen=True)
class JudgeConfig:
    """The judge's limits, every one given: their defaults are `PrmSettings`' (the one owner);
    `swerl.prm.server.judge_config` builds this from the settings."""

    default_votes: int
    max_votes: int
    max_concurrent_requests: int
    request_timeout_s: float
    retry_max_attempts: int
    retry_max_delay_s: float
    max_prompt_tokens: int
    limits: PromptLimits


def _is_connection_error(exc: BaseException) -> bool:
    return isinstance(exc, JudgeConnectionError)


class Judge:
    """Judges steps through `backend`; one instance per service (it owns the global limit)."""

    def __init__(self, backend: JudgeBackend, config: JudgeConfig) -> None:
        self.backend = backend
        self.config = config
        self._slots = asyncio.Semaphore(config.max_concurrent_requests)
        self.in_flight = 0
        self.max_in_flight = 0

    def check(self, step: StepToJudge, votes: int) -> int:
        """Validates a request; returns the number of votes to sample."""
        if not step.issue.strip():
            raise MissingIssue("issue is empty: the judge needs the task the agent was given")
        if not step.step.response.strip():
            raise MissingStepResponse("step.response is empty: there is nothing to judge")
        if not step.episode_id:
            raise MissingEpisodeId("episode_id is required: vote seeds are derived from it")
        if step.step_index < 0:
            raise InvalidStepIndex(
                f"step_index must be >= 0, got {step.step_index}", step_index=step.step_index
            )
        m = votes or self.config.default_votes
        if not 1 <= m <= self.config.max_votes:
            raise VotesOutOfRange(
                f"m must be between 1 and {self.config.max_votes} (0 for the default"
                f" {self.config.default_votes}), got {votes}",
                m=votes,
                max_votes=self.config.max_votes,
            )
        return m

    async def judge(self, step: StepToJudge, *, votes: int = 0, seed: int = 0) -> Verdict:
        """The verdict on `step`: `votes` samples (0 = the default), seeded from `seed`."""
        m = self.check(step, votes)
        started = time.monotonic()
        seeds = [vote_seed(seed, step.episode_id, step.step_index, i) for i in range(m)]
        try:
            prompt = await self._render(step)
        except PromptTooLong as exc:
            sampled = [Vote(seed=s, text="", value=0, error=str(exc)) for s in seeds]
        else:
            votes_of = (self._vote(prompt, s, step.episode_id) for s in seeds)
            sampled = await asyncio.gather(*votes_of)
        model = await self.backend.model_name() if any(not v.error for v in sampled) else ""
        verdict = tally(sampled, judge_model=model, duration_s=time.monotonic() - started)
        metrics.JUDGMENTS.labels(verdict.state.value).inc()
        return verdict

    async def _render(self, step: StepToJudge) -> RenderedPrompt:
        budget = self.config.max_prompt_tokens
        limits = self.config.limits
        for _ in range(_PROMPT_SHRINK_ROUNDS):
            prompt = await self.backend.render(build_messages(step, limits))
            count = prompt.token_count
            if budget <= 0 or count is None or count <= budget:
                return prompt
            limits = limits.halved()
        raise PromptTooLong(
            f"judge prompt of {count} tokens exceeds max_prompt_tokens={budget} even after"
            " cutting the issue, history and output"
        )

    async def _vote(self, prompt: RenderedPrompt, seed: int, routing_key: str) -> Vote:
        try:
            text = await self._sample(prompt, seed, routing_key)
        except JudgeCallError as exc:
            metrics.VOTES.labels("failed").inc()
            return Vote(seed=seed, text="", value=0, error=str(exc))
        vote = Vote(seed=seed, text=text, value=parse_verdict(text))
        metrics.VOTES.labels("valid" if vote.valid else "invalid").inc()
        return vote

    async def _sample(self, prompt: RenderedPrompt, seed: int, routing_key: str) -> str:
        timeout_s = self.config.request_timeout_s
        async for attempt in async_retrying(
            max_attempts=self.config.retry_max_attempts,
            max_delay_s=self.config.retry_max_delay_s,
            retry_on=_is_connection_error,
        ):
            with attempt:
                # A slot is held for one call only, never while waiting to retry.
                async with self._slots:
                    self.in_flight += 1
                    self.max_in_flight = max(self.max_in_flight, self.in_flight)
                    metrics.JUDGE_CALLS_IN_FLIGHT.inc()
                    call_started = time.monotonic()
                    try:
                        return await within(
                            self.backend.sample(prompt, seed, routing_key), timeout_s
                        )
                    except asyncio.TimeoutError as exc:
                        raise JudgeTimeout(
                            f"judge model did not answer within {timeout_s:g} s"
                        ) from exc
                    finally:
                        self.in_flight -= 1
                        metrics.JUDGE_CALLS_IN_FLIGHT.dec()
                        metrics.JUDGE_CALL_DURATION.observe(time.monotonic() - call_started)
        raise AssertionError("unreachable: the retry policy re-raises the last failure")

    async def close(self) -> None:
        await self.backend.close()
