"""PrmService.JudgeStep end to end: a real gRPC server judging through a real HTTP scripted
judge model server, both on port 0 in the test's event loop."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from testkit.prm import ISSUE, JUDGE_TEMPLATE_MARK, make_step, rpc_failure

from swerl.chassis.client import make_channel
from swerl.chassis.hf import load_tokenizer
from swerl.devservers.scripted_prm import DROP, HANG, Reply, Rule, verdict
from swerl.prm.client import judge_request
from swerl.prm.prompt import PromptLimits, build_messages
from swerl.prm.v1 import prm_pb2 as pb
from swerl.prm.v1 import prm_pb2_grpc
from swerl.prm.votes import JudgeState, vote_seed

MALFORMED = Reply(text="The step is fine, I would say +1 overall.")
NOT_A_VERDICT = Reply(text="\\boxed{probably good}")


async def test_step_score_is_the_mean_of_the_votes(scripted, prm):
    judge = await scripted(default=[verdict(1), verdict(-1), verdict(1)])
    running = await prm(judge.url)

    response = await running.stub.JudgeStep(judge_request(make_step(), votes=3), timeout=30)

    assert response.state == pb.JUDGE_STATE_SCORED
    assert response.valid_votes == 3
    assert response.score == pytest.approx(1 / 3)
    assert sorted(v.value for v in response.votes) == [-1, 1, 1]
    assert response.judge_model == "swerl-scripted-judge"
    assert response.judge_duration.ToTimedelta().total_seconds() > 0


async def test_malformed_and_missing_verdicts_are_invalid_votes_left_out_of_the_mean(scripted, prm):
    judge = await scripted(default=[verdict(-1), MALFORMED, NOT_A_VERDICT])
    running = await prm(judge.url)

    response = await running.stub.JudgeStep(judge_request(make_step(), votes=3), timeout=30)

    assert response.state == pb.JUDGE_STATE_SCORED
    assert response.valid_votes == 1
    assert response.score == -1.0
    invalid = [v for v in response.votes if not v.valid]
    assert sorted(v.text for v in invalid) == sorted([MALFORMED.text, NOT_A_VERDICT.text])
    assert all(v.value == 0 and v.error_message == "" for v in invalid)


async def test_a_step_without_any_valid_vote_reports_no_valid_votes(scripted, prm):
    judge = await scripted(default=[MALFORMED])
    running = await prm(judge.url)

    response = await running.stub.JudgeStep(judge_request(make_step(), votes=3), timeout=30)

    assert response.state == pb.JUDGE_STATE_NO_VALID_VOTES
    assert response.valid_votes == 0
    assert len(response.votes) == 3
    assert response.error_message == ""


async def test_m_zero_samples_the_services_default_number_of_votes(scripted, prm):
    judge = await scripted()
    running = await prm(judge.url, default_votes=5)

    response = await running.stub.JudgeStep(judge_request(make_step(), votes=0), timeout=30)

    assert len(response.votes) == 5
    assert len(judge.requests) == 5


async def test_each_vote_is_sampled_with_its_own_seed_from_episode_step_and_vote(scripted, prm):
    judge = await scripted()
    running = await prm(judge.url)
    steps = [make_step(episode_id=e, step_index=s) for e in ("ep-a", "ep-b") for s in (0, 1)]

    responses = await asyncio.gather(
        *(running.stub.JudgeStep(judge_request(st, votes=3, seed=11), timeout=30) for st in steps)
    )

    for step, response in zip(steps, responses, strict=True):
        expected = [vote_seed(11, step.episode_id, step.step_index, i) for i in range(3)]
        assert [v.seed for v in response.votes] == expected
    sent = [r.seed for r in judge.requests]
    assert len(sent) == len(set(sent)) == 12
    assert set(sent) == {v.seed for r in responses for v in r.votes}


async def test_the_same_request_samples_the_same_seeds_again(scripted, prm):
    judge = await scripted()
    running = await prm(judge.url)
    request = judge_request(make_step(), votes=3, seed=5)

    first = await running.stub.JudgeStep(request, timeout=30)
    again = await running.stub.JudgeStep(request, timeout=30)

    assert [v.seed for v in first.votes] == [v.seed for v in again.votes]


async def test_the_prompt_is_tokenized_with_the_judge_models_own_tokenizer_not_the_policys(
    scripted, prm, judge_tokenizer_dir, policy_tokenizer_dir
):
    judge = await scripted()
    running = await prm(judge.url, judge_tokenizer_path=judge_tokenizer_dir)
    step = make_step()

    await running.stub.JudgeStep(judge_request(step, votes=1), timeout=30)

    [sent] = judge.requests
    messages = build_messages(step, PromptLimits())
    judge_tok = load_tokenizer(judge_tokenizer_dir)
    policy_tok = load_tokenizer(policy_tokenizer_dir)

    def ids_of(tokenizer) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))

    assert sent.input_ids == ids_of(judge_tok)
    assert sent.input_ids != ids_of(policy_tok)
    # The judge's chat template (its own marker tokens) framed the prompt, not Qwen3's.
    assert sent.prompt_text.endswith(JUDGE_TEMPLATE_MARK)
    assert "<|im_start|>" not in sent.prompt_text
    assert ISSUE in sent.prompt_text


async def test_a_judge_that_hangs_fails_its_step_within_the_timeout_while_other_steps_score(
    scripted, prm
):
    judge = await scripted(rules=[Rule("HANG-HERE", [HANG])], default=[verdict(1)])
    running = await prm(judge.url, request_timeout_s=0.5)
    hung = make_step("echo HANG-HERE", step_index=1)
    fine = [make_step(f"ls dir-{i}", step_index=i + 2) for i in range(3)]

    started = time.monotonic()
    responses = await asyncio.gather(
        *(running.stub.JudgeStep(judge_request(s, votes=2), timeout=30) for s in [hung, *fine])
    )
    elapsed = time.monotonic() - started

    assert responses[0].state == pb.JUDGE_STATE_FAILED
    assert "did not answer within 0.5 s" in responses[0].error_message
    assert all("did not answer" in v.error_message for v in responses[0].votes)
    assert [r.state for r in responses[1:]] == [pb.JUDGE_STATE_SCORED] * 3
    assert elapsed < 10
    # A timeout is not retried: each hung vote was sent once.
    assert sum("HANG-HERE" in r.prompt_text for r in judge.requests) == 2


async def test_dropped_connections_are_retried_and_the_vote_still_counts(scripted, prm):
    judge = await scripted(default=[DROP, DROP, verdict(-1)])
    running = await prm(judge.url, retry_max_attempts=3)

    response = await running.stub.JudgeStep(judge_request(make_step(), votes=1), timeout=30)

    assert response.state == pb.JUDGE_STATE_SCORED
    assert response.score == -1.0
    assert len(judge.requests) == 3
    assert len({r.seed for r in judge.requests}) == 1  # the same vote, sent again


async def test_http_errors_are_not_retried_and_fail_the_vote(scripted, prm):
    judge = await scripted(default=[Reply(status=503), verdict(1)])
    running = await prm(judge.url)

    response = await running.stub.JudgeStep(judge_request(make_step(), votes=1), timeout=30)

    assert response.state == pb.JUDGE_STATE_FAILED
    assert "HTTP 503" in response.error_message
    assert len(judge.requests) == 1


async def test_an_unreachable_judge_fails_the_step_after_the_retries(prm, unused_tcp_port):
    running = await prm(f"http://127.0.0.1:{unused_tcp_port}", retry_max_attempts=2)

    response = await running.stub.JudgeStep(judge_request(make_step(), votes=2), timeout=30)

    assert response.state == pb.JUDGE_STATE_FAILED
    assert "unreachable" in response.error_message
    assert response.judge_model == ""


async def test_the_global_limit_holds_under_500_concurrent_judge_calls(scripted, prm):
    judge = await scripted(default=[verdict(1, delay_s=0.02)])
    running = await prm(judge.url, max_concurrent_requests=8)
    steps = [make_step(episode_id=f"ep-{i % 50}", step_index=i // 50) for i in range(500)]

    responses = await asyncio.gather(
        *(running.stub.JudgeStep(judge_request(s, votes=1), timeout=120) for s in steps)
    )

    assert [r.state for r in responses] == [pb.JUDGE_STATE_SCORED] * 500
    assert len(judge.requests) == 500
    # Measured at the judge model's server: never more than the limit, and the limit was used.
    assert judge.max_in_flight == 8
    assert running.server.judge.max_in_flight == 8


async def test_the_openai_compatible_backend_judges_through_chat_completions(scripted, prm):
    judge = await scripted(default=[verdict(1), verdict(1), MALFORMED], model_name="judge-7b")
    running = await prm(
        judge.url, backend="openai", judge_model="judge-7b", judge_tokenizer_path=None
    )

    response = await running.stub.JudgeStep(judge_request(make_step(), votes=3), timeout=30)

    assert response.state == pb.JUDGE_STATE_SCORED
    assert response.score == 1.0
    assert response.valid_votes == 2
    assert response.judge_model == "judge-7b"
    assert {r.path for r in judge.requests} == {"/v1/chat/completions"}
    body = judge.requests[0].body
    assert body["model"] == "judge-7b"
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert {r.seed for r in judge.requests} == {v.seed for v in response.votes}


async def test_a_prompt_over_the_token_budget_is_cut_until_it_fits(scripted, prm):
    judge = await scripted()
    running = await prm(judge.url, max_prompt_tokens=3000)
    step = make_step(issue="ISSUE-START " + "y" * 20_000, output="z" * 20_000)

    response = await running.stub.JudgeStep(judge_request(step, votes=1), timeout=30)

    assert response.state == pb.JUDGE_STATE_SCORED
    assert len(judge.requests[0].input_ids) <= 3000
    assert "ISSUE-START" in judge.requests[0].prompt_text


async def test_a_prompt_that_cannot_fit_the_budget_fails_the_step_without_calling_the_judge(
    scripted, prm
):
    judge = await scripted()
    running = await prm(judge.url, max_prompt_tokens=50)

    response = await running.stub.JudgeStep(judge_request(make_step(), votes=2), timeout=30)

    assert response.state == pb.JUDGE_STATE_FAILED
    assert "max_prompt_tokens=50" in response.error_message
    assert judge.requests == []


def _request(**changes) -> pb.JudgeStepRequest:
    request = judge_request(make_step(), votes=1)
    for name, value in changes.items():
        if name == "step":
            request.ClearField("step")
            if value is not None:
                request.step.CopyFrom(value)
        else:
            setattr(request, name, value)
    return request


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"issue": ""}, "ISSUE_MISSING"),
        ({"issue": "  \n "}, "ISSUE_MISSING"),
        ({"step": None}, "STEP_RESPONSE_MISSING"),
        ({"step": pb.CurrentStep(response="", action="ls")}, "STEP_RESPONSE_MISSING"),
        ({"step": pb.CurrentStep(response=" \n\t", action="ls")}, "STEP_RESPONSE_MISSING"),
        ({"episode_id": ""}, "EPISODE_ID_MISSING"),
        ({"step_index": -1}, "STEP_INDEX_INVALID"),
        ({"m": -1}, "VOTES_OUT_OF_RANGE"),
        ({"m": 17}, "VOTES_OUT_OF_RANGE"),
    ],
)
async def test_bad_requests_are_invalid_argument_with_their_reason(scripted, prm, changes, reason):
    judge = await scripted()
    running = await prm(judge.url, max_votes=16)

    code, got = await rpc_failure(running.stub.JudgeStep(_request(**changes), timeout=30))

    assert (code, got) == (grpc.StatusCode.INVALID_ARGUMENT, reason)
    assert judge.requests == []


@pytest.mark.parametrize(
    ("token", "reason"), [(None, "MISSING_TOKEN"), ("wrong-token", "INVALID_TOKEN")]
)
async def test_calls_without_the_bearer_token_are_unauthenticated(scripted, prm, token, reason):
    judge = await scripted()
    running = await prm(judge.url)
    channel = make_channel(running.address, token=token)
    try:
        stub = prm_pb2_grpc.PrmServiceStub(channel)
        code, got = await rpc_failure(stub.JudgeStep(_request(), timeout=30))
    finally:
        await channel.close()

    assert (code, got) == (grpc.StatusCode.UNAUTHENTICATED, reason)


async def test_judgments_report_scored_votes_to_the_client_as_a_verdict(scripted, prm):
    judge = await scripted(default=[verdict(1), MALFORMED])
    running = await prm(judge.url)

    result = await running.client.judge_step(make_step(), votes=2)

    assert result.state is JudgeState.SCORED
    assert result.score == 1.0
    assert result.valid_votes == 1
    assert sorted(v.value for v in result.votes) == [0, 1]


async def test_chat_template_settings_reach_the_judges_template(
    scripted, prm, policy_tokenizer_dir
):
    # A Qwen3 judge with thinking switched off: its template opens an empty think block.
    judge = await scripted(tokenizer_path=policy_tokenizer_dir)
    running = await prm(
        judge.url,
        judge_tokenizer_path=policy_tokenizer_dir,
        chat_template_kwargs={"enable_thinking": False},
    )

    await running.stub.JudgeStep(judge_request(make_step(), votes=1), timeout=30)

    assert judge.requests[0].prompt_text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


async def test_votes_and_judgments_are_counted_in_the_metrics(scripted, prm):
    from prometheus_client import REGISTRY

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    judge = await scripted(default=[verdict(1), MALFORMED])
    running = await prm(judge.url)
    before = {o: value("swerl_prm_votes_total", outcome=o) for o in ("valid", "invalid")}
    scored_before = value("swerl_prm_judgments_total", state="SCORED")

    await running.stub.JudgeStep(judge_request(make_step(), votes=2), timeout=30)

    assert value("swerl_prm_votes_total", outcome="valid") == before["valid"] + 1
    assert value("swerl_prm_votes_total", outcome="invalid") == before["invalid"] + 1
    assert value("swerl_prm_judgments_total", state="SCORED") == scored_before + 1
    assert value("swerl_prm_judge_calls_in_flight") == 0


@pytest.mark.parametrize(
    ("raw_body", "message"),
    [
        ("this is not json", "invalid JSON"),
        ("[1, 2]", "not object"),
        ('{"meta_info": {}}', "has no text"),
        (b'{"text": "\xff\xfe"}', "unreadable answer"),
    ],
)
async def test_an_unreadable_answer_from_the_judge_fails_the_vote_without_a_retry(
    scripted, prm, raw_body, message
):
    judge = await scripted(default=[Reply(raw_body=raw_body)])
    running = await prm(judge.url)

    response = await running.stub.JudgeStep(judge_request(make_step(), votes=1), timeout=30)

    assert response.state == pb.JUDGE_STATE_FAILED
    assert message in response.error_message
    assert len(judge.requests) == 1


async def test_an_openai_style_answer_without_choices_fails_the_vote(scripted, prm):
    judge = await scripted(default=[Reply(raw_body='{"choices": []}')])
    running = await prm(judge.url, backend="openai", judge_model="m", judge_tokenizer_path=None)

    response = await running.stub.JudgeStep(judge_request(make_step(), votes=1), timeout=30)

    assert response.state == pb.JUDGE_STATE_FAILED
    assert "no choices[0].message" in response.error_message


async def test_a_judge_server_that_cannot_name_its_model_does_not_hold_up_judgments(
    scripted, prm, monkeypatch
):
    import swerl.prm.backends

    monkeypatch.setattr(swerl.prm.backends, "_MODEL_INFO_TIMEOUT_S", 0.3)
    judge = await scripted(model_info=HANG)
    running = await prm(judge.url)

    first = await running.stub.JudgeStep(judge_request(make_step(), votes=1), timeout=30)
    started = time.monotonic()
    second = await running.stub.JudgeStep(judge_request(make_step(), votes=1), timeout=30)

    assert (first.state, second.state) == (pb.JUDGE_STATE_SCORED, pb.JUDGE_STATE_SCORED)
    assert first.judge_model == second.judge_model == ""
    assert judge.model_info_requests == 1  # not asked again right away
    assert time.monotonic() - started < 0.3


async def test_the_configured_judge_model_name_is_reported_without_asking(scripted, prm):
    judge = await scripted()
    running = await prm(judge.url, judge_model="qwen3-judge-8b")

    response = await running.stub.JudgeStep(judge_request(make_step(), votes=1), timeout=30)

    assert response.judge_model == "qwen3-judge-8b"
    assert judge.model_info_requests == 0


@pytest.mark.parametrize("backend", ["sglang", "openai"])
async def test_every_vote_carries_the_steps_episode_id_as_its_routing_key(scripted, prm, backend):
    judge = await scripted()
    openai = {"judge_model": "judge-7b", "judge_tokenizer_path": None}
    running = await prm(judge.url, backend=backend, **(openai if backend == "openai" else {}))

    for episode_id in ("ep-a", "ep-b"):
        request = judge_request(make_step(episode_id=episode_id), votes=2)
        await running.stub.JudgeStep(request, timeout=30)

    keys = [r.headers.get("X-SMG-Routing-Key") for r in judge.requests]
    assert sorted(keys) == ["ep-a", "ep-a", "ep-b", "ep-b"]


async def test_the_routing_key_header_is_configurable_and_can_be_turned_off(scripted, prm):
    judge = await scripted()
    renamed = await prm(judge.url, routing_key_header="X-Session")
    silent = await prm(judge.url, routing_key_header="")

    await renamed.stub.JudgeStep(judge_request(make_step(episode_id="ep-c"), votes=1), timeout=30)
    await silent.stub.JudgeStep(judge_request(make_step(episode_id="ep-d"), votes=1), timeout=30)

    first, second = judge.requests
    assert first.headers.get("X-Session") == "ep-c" and "X-SMG-Routing-Key" not in first.headers
    assert "X-Session" not in second.headers and "X-SMG-Routing-Key" not in second.headers
