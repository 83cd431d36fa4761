"""Votes of the PRM judge: reading a verdict from a sample's text, seeding samples, averaging.

A vote is one sample of the judge model. Its verdict is the first `\\boxed{+1}` or `\\boxed{-1}`
in the text the model wrote after its reasoning; a sample without one is an invalid vote and
takes no part in the score. A step's score is the mean of its valid votes; a step whose votes
are all invalid has no score at all (`NO_VALID_VOTES`), which is not the same as a score of 0.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

# `\boxed{ +1 }`, `\boxed{1}`, `\boxed{-1}`, a Unicode minus (U+2212), optionally inside `$`.
_VERDICT = re.compile(r"\\boxed\{\s*\$?\s*([+\-\u2212]?)\s*1\s*\$?\s*\}")
_THINK_END = "</think>"
_THINK_START = "<think>"
# Seeds are non-negative int64 values: SGLang's `sampling_seed` and OpenAI's `seed` accept them.
_SEED_BITS = 63


class JudgeState(enum.Enum):
    """Outcome of judging one step (mirrors swerl.prm.v1.JudgeState)."""

    SCORED = "SCORED"
    NO_VALID_VOTES = "NO_VALID_VOTES"
    FAILED = "FAILED"


@dataclass(frozen=True)
class Vote:
    """One sample of the judge: its text, its verdict (+1/-1, 0 when invalid) and seed.

    `error` says why the judge could not be queried for this vote (timeout, connection); a vote
    with an error is invalid and its text is empty.
    """

    seed: int
    text: str
    value: int
    error: str = ""

    @property
    def valid(self) -> bool:
        return self.value != 0


@dataclass(frozen=True)
class Verdict:
    """The judgment of one step: every vote in seed order, and the score of the valid ones."""

    state: JudgeState
    votes: tuple[Vote, ...]
    score: float = 0.0
    error_message: str = ""
    judge_model: str = ""
    duration_s: float = 0.0

    @property
    def valid_votes(self) -> int:
        return sum(1 for vote in self.votes if vote.valid)


def parse_verdict(text: str) -> int:
    """+1 or -1 from the first boxed verdict after the reasoning; 0 when there is none.

    The reasoning of thinking models (`<think>...</think>`) is skipped: it often quotes both
    verdicts while weighing them. A reasoning block that never closed (the sample was cut off)
    leaves no answer, so the vote is invalid.
    """
    answer = text
    if _THINK_END in answer:
        answer = answer.rsplit(_THINK_END, 1)[1]
    elif _THINK_START in answer:
        return 0
    match = _VERDICT.search(answer)
    if match is None:
        return 0
    return -1 if match.group(1) in ("-", "\u2212") else 1


def vote_seed(base_seed: int, episode_id: str, step_index: int, vote_index: int) -> int:
    """The sampling seed of one vote, derived from (base seed, episode, step, vote).

    Every (episode, step, vote) gets its own seed, so votes neither repeat across the steps of
    an episode nor across the episodes of a group; the same inputs always give the same seed,
    so a retried judgment samples the same votes. A 63-bit hash makes a collision among even
    millions of votes vanishingly unlikely.
    """
    key = f"{base_seed}\x1f{episode_id}\x1f{step_index}\x1f{vote_index}".encode()
    digest = hashlib.blake2b(key, digest_size=8, person=b"swerl.prm.seed").digest()
    return int.from_bytes(digest, "big") >> (64 - _SEED_BITS)


def tally(votes: Sequence[Vote], *, judge_model: str = "", duration_s: float = 0.0) -> Verdict:
    """The verdict of a step's votes: mean of the valid ones, or why there is no score.

    FAILED when the judge could not be queried for any vote; NO_VALID_VOTES when it answered
    but no answer held a verdict; SCORED otherwise (votes that failed count as invalid).
    """
    sampled = tuple(votes)
    answered = [vote for vote in sampled if not vote.error]
    valid = [vote.value for vote in sampled if vote.valid]
    if not answered:
        errors = sorted({vote.error for vote in sampled})
        state, score, message = JudgeState.FAILED, 0.0, "; ".join(errors) or "no votes sampled"
    elif not valid:
        state, score, message = JudgeState.NO_VALID_VOTES, 0.0, ""
    else:
        state, score, message = JudgeState.SCORED, sum(valid) / len(valid), ""
    return Verdict(
        state,
        votes=sampled,
        score=score,
        error_message=message,
        judge_model=judge_model,
        duration_s=duration_s,
    )
