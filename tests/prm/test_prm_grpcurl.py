"""PrmService as an operator sees it through grpcurl (reflection, JudgeStep, errors).

grpcurl is a blocking subprocess talking to servers on this test's event loop, so it runs
through `asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess

import grpc
import pytest
from google.rpc import error_details_pb2
from testkit.grpcurl import json_messages
from testkit.prm import ISSUE, TOKEN

from swerl.devservers.scripted_prm import verdict


@pytest.fixture
def grpcurl(grpcurl_bin):
    """Runs grpcurl (the `grpcurl_bin` fixture's) against a PRM service with its token."""

    async def run(
        address: str, *command: str, data: dict | None = None, flags=()
    ) -> subprocess.CompletedProcess[str]:
        argv = [grpcurl_bin, "-plaintext", "-H", f"authorization: Bearer {TOKEN}", *flags]
        if data is not None:
            argv += ["-d", "@"]
        argv += [address, *command]
        return await asyncio.to_thread(
            subprocess.run,
            argv,
            input=json.dumps(data) if data is not None else None,
            capture_output=True,
            text=True,
            timeout=60,
        )

    return run


JUDGE_STEP = {
    "episode_id": "ep-grpcurl",
    "step_index": 2,
    "issue": ISSUE,
    "history": [
        {"action": "ls", "exit_code": 0, "output_head": "listutils\ntests"},
        {"format_error": True},
    ],
    "step": {
        "response": "Find the function.\n```bash\ngrep -n chunk listutils/core.py\n```",
        "action": "grep -n chunk listutils/core.py",
        "exit_code": 0,
        "output": "12:def chunk(items, size):",
    },
    "m": 3,
    "seed": "42",
}


@pytest.fixture
async def served(scripted, prm):
    judge = await scripted(default=[verdict(1), verdict(1), verdict(-1)])
    return await prm(judge.url)


async def test_reflection_lists_and_describes_the_prm_service(served, grpcurl):
    listed = await grpcurl(served.address, "list")
    described = await grpcurl(served.address, "describe", "swerl.prm.v1.PrmService")

    assert listed.returncode == 0, listed.stderr
    assert "swerl.prm.v1.PrmService" in listed.stdout.split()
    assert "rpc JudgeStep ( .swerl.prm.v1.JudgeStepRequest )" in described.stdout


async def test_grpcurl_calls_judge_step_and_gets_votes_and_a_score(served, grpcurl):
    done = await grpcurl(served.address, "swerl.prm.v1.PrmService/JudgeStep", data=JUDGE_STEP)

    assert done.returncode == 0, done.stderr
    [response] = json_messages(done.stdout)
    assert response["state"] == "JUDGE_STATE_SCORED"
    assert response["valid_votes"] == 3
    assert response["score"] == pytest.approx(1 / 3)
    assert len(response["votes"]) == 3
    assert len({vote["seed"] for vote in response["votes"]}) == 3


async def test_grpcurl_sees_a_bad_request_as_invalid_argument_with_its_reason(served, grpcurl):
    done = await grpcurl(
        served.address,
        "swerl.prm.v1.PrmService/JudgeStep",
        data={**JUDGE_STEP, "m": 99},
        flags=("-format-error",),
    )

    assert done.returncode != 0
    status = json.loads(done.stderr)
    assert status["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    [detail] = status["details"]
    assert detail["@type"] == "type.googleapis.com/google.rpc.ErrorInfo"
    if "@value" in detail:  # grpcurl renders ErrorInfo only when it can resolve its schema.
        reason = error_details_pb2.ErrorInfo.FromString(base64.b64decode(detail["@value"])).reason
    else:
        reason = detail["reason"]
    assert reason == "VOTES_OUT_OF_RANGE"
