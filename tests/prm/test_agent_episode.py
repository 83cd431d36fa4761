"""A whole agent episode with PRM on: real agent service, pool and exec node on dockerd, the
replay policy (Qwen3 tokenizer), and the PRM service judging through a scripted judge model with
its own, different tokenizer. Turns 2 and 4 are format errors; every score lands on its turn."""

from __future__ import annotations

import subprocess

import pytest
from testkit.prm import TOKEN

from swerl.agent.config import SUBMIT_SENTINEL
from swerl.agent.judging.prm_client import PrmJudgeFactory
from swerl.agent.server import AgentServer
from swerl.agent.settings import AgentSettings
from swerl.agent.v1 import agent_pb2 as apb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import make_channel
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir
from swerl.chassis.timeconv import duration_pb
from swerl.devservers.replay import ReplayPolicyServer, patch_turn, script_key
from swerl.devservers.scripted_prm import HANG, Reply, Rule, verdict
from swerl.stack import local_stack
from swerl.tasks import default_tasks_dir, load_tasks
from swerl.validate import instance_to_pb

pytestmark = pytest.mark.docker


def bash(text: str, command: str) -> str:
    return f"{text}\n\n```bash\n{command}\n```"


def script(gold_patch: str) -> list[str]:
    # Markers sit in the prose: the judge sees a turn's full response only when judging it.
    return [
        bash("MARK-T0 Let me look around.", "git status --short && ls"),
        bash("MARK-T1 Which Python is there?", "python3 --version"),
        "MARK-T2 I need to think about this some more before running anything.",
        patch_turn(gold_patch, "MARK-T3 I found the bug; applying the fix."),
        "MARK-T4 Two at once:\n```bash\nls\n```\n```bash\npwd\n```",
        bash("MARK-T5 Run the tests.", "python3 -m pytest -q 2>&1 | tail -n 3"),
        bash("MARK-T6 Submitting.", f"echo {SUBMIT_SENTINEL} && git add -A && git diff --cached"),
    ]


JUDGE_RULES = [
    Rule("MARK-T0", [verdict(1, delay_s=0.3)]),
    Rule("MARK-T1", [verdict(-1, delay_s=0.1)]),
    Rule("MARK-T3", [verdict(1), verdict(-1), verdict(1)]),
    Rule("MARK-T5", [Reply(text="The tests ran. Fine, I guess.")]),
    Rule("MARK-T6", [HANG]),
]


def swerl_containers(prefix: str) -> list[str]:
    out = subprocess.run(
        [
            "docker",
            "ps",
            "-a",
            "--filter",
            "label=swerl.node",
            "--format",
            '{{.Label "swerl.node"}}',
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [name for name in out if name.startswith(prefix)]


async def test_an_episode_with_format_errors_in_turns_2_and_4_scores_every_turn_in_place(
    base_image, scripted, prm, judge_tokenizer_dir
):
    from swerl.tasks import build_images

    task = load_tasks(default_tasks_dir())[0]
    build_images([task], base_image=base_image, progress=lambda *_: None)
    judge = await scripted(rules=JUDGE_RULES)
    judge_service = await prm(judge.url, request_timeout_s=2.0)
    replay = ReplayPolicyServer(
        {script_key(task.instance["problem_statement"]): script(task.gold_patch)}
    )
    policy_url = await replay.start()
    factory = PrmJudgeFactory(token=TOKEN)
    try:
        async with local_stack(nodes=1, purpose="prm-e2e", token=TOKEN) as stack:
            settings = AgentSettings(
                host="127.0.0.1",
                port=0,
                auth_token=TOKEN,
                pool_address=stack.pool_address,
                log_level="warning",
                drain_grace_s=1.0,
            )
            agent = AgentServer(settings, judge_factory=factory)
            await agent.start()
            channel = make_channel(agent.server.address, token=TOKEN)
            try:
                start = apb.EpisodeStart(
                    episode_id="prm-e2e-1",
                    instance=instance_to_pb(task.instance),
                    policy=apb.PolicyConfig(
                        endpoint=policy_url,
                        api=apb.POLICY_API_SGLANG_GENERATE,
                        model="replay",
                        tokenizer_path=str(bundled_qwen3_tokenizer_dir()),
                    ),
                    limits=apb.EpisodeLimits(
                        max_turns=10,
                        max_new_tokens=2048,
                        command_timeout=duration_pb(60),
                        eval_timeout=duration_pb(300),
                    ),
                    prm=apb.PrmConfig(
                        enabled=True,
                        endpoint=judge_service.address,
                        m=3,
                        coef=0.5,
                        seed=3,
                        timeout=duration_pb(20),
                    ),
                    options=apb.EpisodeOptions(owner="prm-e2e"),
                )
                call = agent_pb2_grpc.AgentServiceStub(channel).RunEpisode(
                    iter([apb.RunEpisodeRequest(start=start)]), timeout=600
                )
                messages = [message async for message in call]
            finally:
                await channel.close()
                await agent.stop(0)
    finally:
        await factory.close()
        await replay.stop()

    turns = [m.turn for m in messages if m.WhichOneof("kind") == "turn"]
    streamed = [m.prm_score for m in messages if m.WhichOneof("kind") == "prm_score"]
    [result] = [m.result for m in messages if m.WhichOneof("kind") == "result"]
    assert result.status == apb.EPISODE_STATUS_SUBMITTED, result.error_message
    assert [t.format_error for t in turns] == [False, False, True, False, True, False, False]
    assert result.reward == 1.0

    S = apb
    expected = [
        (0, S.STEP_SCORE_STATE_SCORED, 1.0, 3),
        (1, S.STEP_SCORE_STATE_SCORED, -1.0, 3),
        (2, S.STEP_SCORE_STATE_NOT_JUDGED, 0.0, 0),
        (3, S.STEP_SCORE_STATE_SCORED, 1 / 3, 3),
        (4, S.STEP_SCORE_STATE_NOT_JUDGED, 0.0, 0),
        (5, S.STEP_SCORE_STATE_NO_VALID_VOTES, 0.0, 0),
        (6, S.STEP_SCORE_STATE_FAILED, 0.0, 0),
    ]
    got = [
        (s.turn_index, s.state, pytest.approx(s.score), s.valid_votes) for s in result.step_scores
    ]
    assert got == expected
    assert sorted(s.turn_index for s in streamed) == list(range(7))
    # Format-error turns never reached the judge; later turns read them as format errors.
    assert not any("MARK-T2" in r.prompt_text or "MARK-T4" in r.prompt_text for r in judge.requests)
    turn5 = next(r.prompt_text for r in judge.requests if "MARK-T5" in r.prompt_text)
    assert "Step 2: (format error" in turn5 and "Step 4: (format error" in turn5
    assert "Step 3: $ echo" in turn5
    # One routing key, the episode id, on every policy call and every judge call.
    assert {call.headers.get("X-SMG-Routing-Key") for call in replay.stats.calls} == {"prm-e2e-1"}
    assert {r.headers.get("X-SMG-Routing-Key") for r in judge.requests} == {"prm-e2e-1"}
    # Every vote of the episode had its own seed.
    seeds = [r.seed for r in judge.requests]
    assert len(seeds) == len(set(seeds)) == 15
    # The whole-trajectory sample: outcome + coef * mean of the usable scores.
    assert result.trajectory.reward == pytest.approx(1.0 + 0.5 * (1 - 1 + 1 / 3) / 3)
    assert swerl_containers("prm-e2e") == []
