"""A judge reply that was aborted or cut at its length limit is not a vote (issue 23 item 6):
the verdict its text may hold was not the judge's last word. Both backends against the real
scripted judge server (SGLang `/generate` with `meta_info.finish_reason.type`, OpenAI chat
completions with `finish_reason`), through the real PRM gRPC service."""

from __future__ import annotations

import pytest
from testkit.prm import make_step

from swerl.devservers.scripted_prm import verdict
from swerl.prm.client import judge_request
from swerl.prm.v1 import prm_pb2 as pb


@pytest.mark.parametrize("backend", ["sglang", "openai"])
@pytest.mark.parametrize("finish", ["length", "abort"])
async def test_a_reply_cut_at_the_length_limit_or_aborted_is_not_a_vote(
    scripted, prm, backend, finish
):
    # The cut reply even ends in a well-formed verdict: it still must not count.
    judge = await scripted(default=[verdict(1), verdict(-1, finish=finish), verdict(1)])
    extra = {"backend": backend, "judge_model": "judge"} if backend == "openai" else {}
    running = await prm(judge.url, **extra)

    response = await running.stub.JudgeStep(judge_request(make_step(), votes=3), timeout=30)

    assert response.state == pb.JUDGE_STATE_SCORED
    assert response.valid_votes == 2 and response.score == 1.0
    (cut,) = [v for v in response.votes if not v.valid]
    assert cut.value == 0 and finish in cut.error_message


async def test_a_step_whose_every_reply_was_cut_has_no_valid_vote(scripted, prm):
    judge = await scripted(default=[verdict(1, finish="length")])
    running = await prm(judge.url)

    response = await running.stub.JudgeStep(judge_request(make_step(), votes=2), timeout=30)

    assert response.state == pb.JUDGE_STATE_FAILED, "every vote failed"
    assert response.valid_votes == 0
    assert all("finish_reason" in v.error_message for v in response.votes)
