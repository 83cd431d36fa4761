"""Failures of the PRM service.

Bad requests are `SwerlError`s (one gRPC code and one ErrorInfo reason each). Trouble with the
judge model is not an RPC error: it is a `JudgeCallError` on one vote, which the judge records
on the vote and, when every vote failed, reports as a FAILED judgment.
"""

from __future__ import annotations

from swerl.chassis.errors import InvalidArgument


class MissingIssue(InvalidArgument):
    reason = "ISSUE_MISSING"


class MissingStepResponse(InvalidArgument):
    """No step, or a step whose response text is empty: there is nothing to judge."""

    reason = "STEP_RESPONSE_MISSING"


class MissingEpisodeId(InvalidArgument):
    """Vote seeds derive from the episode id; without one every episode would share seeds."""

    reason = "EPISODE_ID_MISSING"


class InvalidStepIndex(InvalidArgument):
    reason = "STEP_INDEX_INVALID"


class VotesOutOfRange(InvalidArgument):
    reason = "VOTES_OUT_OF_RANGE"


class JudgeCallError(Exception):
    """One call to the judge model failed; the message says why, for the vote's error."""


class JudgeConnectionError(JudgeCallError):
    """The judge model's server could not be reached or dropped the connection (retried)."""


class JudgeTimeout(JudgeCallError):
    """The judge model did not answer within the per-call timeout (not retried)."""


class JudgeBadResponse(JudgeCallError):
    """The judge model's server answered with an HTTP error or an unreadable body."""


class JudgeReplyCut(JudgeCallError):
    """The judge's reply was aborted or cut at its length limit: whatever verdict its text
    holds was not the judge's last word, so it is no vote (not retried)."""


class PromptTooLong(JudgeCallError):
    """Even the shortest prompt the limits allow exceeds the judge's context budget."""
