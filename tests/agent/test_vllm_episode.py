"""RunEpisode with POLICY_API_VLLM_GENERATE on the real vLLM engine: real agent, pool, exec node
and dockerd, a recording proxy between the agent and the engine. The tiny model is random, so
its replies are format errors and the episodes end LIMIT_TURNS; what is checked is that every
record is exactly what the engine was sent and sampled, that the engine's context refusal ends
the episode LIMIT_CONTEXT, that a cancel mid-generation aborts the request on the engine, and
that a bad model, a gone engine and the other engine's API end INFRA_ERROR naming what
happened."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from testkit.agent import (
    AgentStack,
    agent_stack,
    bundled_tasks,
    result_of,
    run_to_result,
    sandboxes_left,
    start_for,
)
from testkit.vllm_engine import (
    RecordingProxy,
    VllmEngine,
    assert_records_are_the_engines,
    wait_until_sampling,
)

from swerl.agent.v1 import agent_pb2 as pb
from swerl.devservers.replay import ReplayPolicyServer

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("base_image")]


@contextlib.asynccontextmanager
async def vllm_stack(engine: VllmEngine) -> AsyncIterator[tuple[AgentStack, RecordingProxy]]:
    proxy = RecordingProxy(engine.url)
    await proxy.start()
    try:
        # Two attempts, a second apart, for a policy that fails: reported in seconds.
        async with agent_stack(policy_connect_attempts=2, policy_connect_max_delay_s=1.0) as env:
            yield env, proxy
    finally:
        await proxy.stop()


def vllm_start(
    engine: VllmEngine, url: str, episode_id: str, *, max_turns: int = 2
) -> pb.EpisodeStart:
    start = start_for(bundled_tasks()[0], url, episode_id, max_turns=max_turns)
    start.policy.api = pb.POLICY_API_VLLM_GENERATE
    start.policy.model = engine.model
    start.policy.sampling_params.update({"sampling_seed": 5})
    start.limits.max_new_tokens = 24
    start.limits.max_context_tokens = 32_000  # only the engine's 4096 can refuse
    start.options.skip_evaluation = True
    return start


async def test_an_episode_on_vllm_records_exactly_what_the_engine_was_sent_and_sampled(
    vllm_engine: VllmEngine,
) -> None:
    async with vllm_stack(vllm_engine) as (env, proxy):
        messages = await run_to_result(env.stub, vllm_start(vllm_engine, proxy.url, "vllm-e1"))
        whole = list(proxy.exchanges)
        per_turn = vllm_start(vllm_engine, proxy.url, "vllm-e2")
        per_turn.options.dynamic_history = True  # one record per turn
        dynamic = result_of(await run_to_result(env.stub, per_turn))
    result = result_of(messages)
    assert result.status == pb.EPISODE_STATUS_LIMIT_TURNS, result.error_message
    turns = [m.turn for m in messages if m.WhichOneof("kind") == "turn"]
    assert len(turns) == 2 and all(t.format_error for t in turns), "random text: no command"
    first = RecordingProxy(vllm_engine.url, exchanges=whole)
    assert len(first.generates()) == 2
    sent = first.generates()[0].request_json()
    assert sent["request_id"].startswith("vllm-e1-") and sent["model"] == vllm_engine.model
    assert sent["sampling_params"] == {
        "temperature": 1.0,
        "top_p": 1.0,
        "seed": 5,
        "max_tokens": 24,
        "logprobs": 0,
    }
    assert_records_are_the_engines([result.trajectory], first)
    assert list(result.trajectory.weight_versions) == ["default", "default"]
    assert dynamic.status == pb.EPISODE_STATUS_LIMIT_TURNS, dynamic.error_message
    second = RecordingProxy(vllm_engine.url, exchanges=proxy.exchanges[len(whole) :])
    assert len(dynamic.turns) == 2 == len(second.generates())
    assert_records_are_the_engines(list(dynamic.turns), second)
    assert [list(t.weight_versions) for t in dynamic.turns] == [["default"], ["default"]]
    assert sandboxes_left() == []


async def test_a_prompt_over_vllms_max_model_len_ends_the_episode_limit_context(
    vllm_engine: VllmEngine,
) -> None:
    async with vllm_stack(vllm_engine) as (env, proxy):
        start = vllm_start(vllm_engine, proxy.url, "vllm-ctx")
        start.instance.problem_statement = "Fix the parser in a.py. " * 1500  # ~7k tokens
        messages = await run_to_result(env.stub, start)
    result = result_of(messages)
    assert result.status == pb.EPISODE_STATUS_LIMIT_CONTEXT, result.error_message
    assert result.error_reason == ""
    [refused] = proxy.generates()
    assert refused.status == 400
    assert "longer than the maximum model length of 4096" in refused.response.decode()
    assert sandboxes_left() == []


@pytest.mark.vllm_alone
async def test_cancelling_an_episode_mid_generation_aborts_the_request_on_vllm(
    vllm_engine: VllmEngine,
) -> None:
    async with vllm_stack(vllm_engine) as (env, proxy):
        start = vllm_start(vllm_engine, proxy.url, "vllm-cancel")
        start.limits.max_new_tokens = 3500
        start.policy.sampling_params.update({"ignore_eos": True})
        call = env.stub.RunEpisode(timeout=300)
        await call.write(pb.RunEpisodeRequest(start=start))
        await proxy.wait_for(lambda: any(p.endswith("/generate") for p, _ in proxy.started))
        await wait_until_sampling(vllm_engine)  # the engine's scheduler holds the request
        await asyncio.sleep(0.5)
        await call.write(pb.RunEpisodeRequest(cancel=pb.EpisodeCancel(reason="trainer stop")))
        messages = [m async for m in call]
        await proxy.wait_for(lambda: proxy.aborts() and proxy.generates())
    result = result_of(messages)
    assert result.status == pb.EPISODE_STATUS_CANCELLED
    sent = json.loads(next(b for p, b in proxy.started if p.endswith("/generate")))
    assert proxy.aborts()[0].request_json() == {
        "request_ids": ["generate-tokens-" + sent["request_id"]]
    }
    # The engine's own ending after an abort it answered is usually `abort`; about 1 run in 5
    # vLLM 0.32 samples it to its end (docs/engines.md); the episode ends CANCELLED either way.
    answered = proxy.generates()[0].response_json()["choices"][0]
    assert answered["finish_reason"] in ("abort", "length")
    assert sandboxes_left() == []


async def test_bad_model_gone_engine_and_api_mismatch_end_infra_error_naming_them(
    vllm_engine: VllmEngine,
) -> None:
    replay = ReplayPolicyServer({})
    replay_url = await replay.start()
    try:
        async with vllm_stack(vllm_engine) as (env, proxy):
            bad_model = vllm_start(vllm_engine, proxy.url, "vllm-model")
            bad_model.policy.model = "no-such-model"
            sglang_on_vllm = vllm_start(vllm_engine, proxy.url, "vllm-as-sglang")
            sglang_on_vllm.policy.api = pb.POLICY_API_SGLANG_GENERATE
            vllm_on_sglang = vllm_start(vllm_engine, replay_url, "sglang-as-vllm")
            results = {}
            for start in (bad_model, sglang_on_vllm, vllm_on_sglang):
                results[start.episode_id] = result_of(await run_to_result(env.stub, start))
            await proxy.stop()  # the engine's address now refuses connections
            gone = vllm_start(vllm_engine, proxy.url, "vllm-gone")
            results["gone"] = result_of(await run_to_result(env.stub, gone))
    finally:
        await replay.stop()
    for result in results.values():
        assert result.status == pb.EPISODE_STATUS_INFRA_ERROR, result.error_message
    model = results["vllm-model"]
    assert model.error_reason == "POLICY_ERROR"
    assert "serves no such model" in model.error_message
    assert "`no-such-model` does not exist" in model.error_message
    as_sglang = results["vllm-as-sglang"]
    assert as_sglang.error_reason == "POLICY_ERROR"
    assert "policy.api is SGLANG_GENERATE" in as_sglang.error_message
    assert "does not speak SGLang's /generate" in as_sglang.error_message
    as_vllm = results["sglang-as-vllm"]
    assert as_vllm.error_reason == "POLICY_ERROR"
    assert "policy.api is VLLM_GENERATE" in as_vllm.error_message
    assert "does not speak vLLM's token API" in as_vllm.error_message
    assert results["gone"].error_reason == "POLICY_UNAVAILABLE"
    assert "unreachable" in results["gone"].error_message
    assert sandboxes_left() == []


async def test_a_harness_episode_on_vllm_records_exactly_what_the_engine_sampled(
    vllm_engine: VllmEngine,
) -> None:
    """mini-swe-agent on the episode's gateway session, the session on vLLM: the random model's
    replies are no commands, so the harness stops at its step limit (max_turns) without a
    submission (HARNESS_FAILED); the session's records are exactly the engine's."""
    async with vllm_stack(vllm_engine) as (env, proxy):
        start = vllm_start(vllm_engine, proxy.url, "vllm-mini")
        start.options.harness = "mini-swe-agent"
        result = result_of(await run_to_result(env.stub, start))
    assert result.status == pb.EPISODE_STATUS_HARNESS_FAILED, result.error_message
    assert result.error_message == "mini-swe-agent exited LimitsExceeded without a submission"
    assert len(proxy.generates()) == 2
    assert proxy.generates(), "the harness called the engine"
    assert all(e.path == "/inference/v1/generate" for e in proxy.exchanges)
    records = [result.trajectory] if not result.chains else list(result.chains)
    assert_records_are_the_engines(records, proxy)
    assert sandboxes_left() == []
