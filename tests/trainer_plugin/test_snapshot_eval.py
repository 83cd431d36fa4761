"""miles' snapshot evaluation (`--eval-num-gpus`, or a checkpoint eval function: miles sets
`args.eval_uses_snapshots`, utils/arguments.py:81) calls generate with a copy of `args` whose
router is the snapshot's engines (rollout/checkpoint_eval.py:35-47 `retarget_args`). There the
router in `args` must win over a configured swerl_policy_endpoint, or the training router's
weights are the ones evaluated (issue 41 point 7). Training calls keep the configured one."""

from __future__ import annotations

import copy

import pytest
from testkit.playback import PlaybackAgent, PlaybackServer, Scenario, result
from testkit.plugin import make_args, make_sample

pytestmark = pytest.mark.usefixtures("fw")

TRAINING_ROUTER = "http://10.0.0.1:30000"


@pytest.mark.parametrize(
    ("snapshots", "evaluation", "expected"),
    [
        (True, True, "http://10.0.0.9:31000"),  # the retargeted copy's router
        (True, False, TRAINING_ROUTER),  # training calls: the configured endpoint
        (False, True, TRAINING_ROUTER),  # eval on the training engines
    ],
)
async def test_a_snapshot_eval_samples_from_the_snapshots_router(
    fw, sampling_params, snapshots, evaluation, expected
) -> None:
    agent = PlaybackAgent(lambda start: Scenario(result=result(start)))
    async with PlaybackServer(agent) as server:
        args = make_args([server.address], policy_endpoint=TRAINING_ROUTER)
        args.eval_uses_snapshots = snapshots
        # What retarget_args does to the copy handed to each eval call.
        eval_args = copy.copy(args)
        eval_args.sglang_router_ip, eval_args.sglang_router_port = "10.0.0.9", 31000
        await fw.generate(
            eval_args if evaluation else args, make_sample(), sampling_params, evaluation
        )
    (start,) = agent.starts
    assert start.policy.endpoint == expected
