"""POLICY_API_VLLM_GENERATE's checks that need no engine: the sampling params' mapping to vLLM's
names, each key vLLM has no counterpart for refused with INVALID_ARGUMENT naming it before any
lease (RunEpisode) or session (OpenSession), the reply's finish reasons and weight versions, and
a VLLM_GENERATE endpoint that serves SGLang's API (the replay) named as the mismatch it is."""

from __future__ import annotations

import json

import grpc
import openai
import pytest
from google.protobuf import struct_pb2
from testkit.agent import TOKENIZER_DIR, bundled_tasks, start_for
from testkit.gateway import KEY, gateway_env

from swerl.agent.gateway.session import ENGINE_VLLM
from swerl.agent.policy.clients import PolicyUnavailable
from swerl.agent.policy.vllm import (
    UnsupportedSamplingParam,
    parse_vllm_reply,
    vllm_sampling_params,
)
from swerl.agent.server import AgentServer
from swerl.agent.settings import AgentSettings
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import error_info, make_channel

TOKEN = "vllm-checks-token"


def test_sglang_named_params_become_vllms() -> None:
    params = {
        "max_new_tokens": 64,
        "min_new_tokens": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.05,
        "stop": ["</s>"],
        "stop_token_ids": [7],
        "ignore_eos": False,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "sampling_seed": 11,
        "repetition_penalty": 1.1,
        "logit_bias": {"42": -5},
        "regex": "a+",
        "n": 1,
    }
    assert vllm_sampling_params(params) == {
        "max_tokens": 64,
        "min_tokens": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "min_p": 0.05,
        "stop": ["</s>"],
        "stop_token_ids": [7],
        "ignore_eos": False,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "seed": 11,
        "repetition_penalty": 1.1,
        "logit_bias": {42: -5.0},
        "structured_outputs": {"regex": "a+"},
    }
    assert vllm_sampling_params({"top_k": 20}) == {"top_k": 20}


@pytest.mark.parametrize(
    ("params", "key", "words"),
    [
        ({"temperature": 1.0, "frobnicate": 2}, "frobnicate", "vLLM has no such sampling param"),
        ({"custom_params": {"return_top_p_token_ids": True}}, "custom_params", "top-p replay"),
        ({"n": 4}, "n", "one reply per call"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        ({"regex": "a", "json_schema": "{}"}, "regex", "one of json_schema, regex and ebnf"),
    ],
)
def test_a_param_vllm_has_no_counterpart_for_is_named(params, key, words) -> None:
    with pytest.raises(UnsupportedSamplingParam) as refused:
        vllm_sampling_params(params)
    assert refused.value.key == key
    assert refused.value.message.startswith(f"sampling_params.{key}: ")
    assert words in refused.value.message


def _reply(**choice) -> bytes:
    base = {
        "index": 0,
        "finish_reason": "stop",
        "token_ids": [5, 6],
        "weight_versions": [{"version": "v3", "start": 0, "end": 2}],
        "logprobs": {
            "content": [
                {"token_id": 5, "logprob": -0.5, "top_logprobs": []},
                {"token_id": 6, "logprob": -1.5, "top_logprobs": []},
            ]
        },
    }
    base.update(choice)
    return json.dumps({"request_id": "generate-tokens-x", "choices": [base]}).encode()


def test_a_reply_is_the_engines_ids_logprobs_finish_and_weight_version() -> None:
    gen = parse_vllm_reply(_reply())
    assert (gen.output_ids, gen.logprobs, gen.finish_reason) == ([5, 6], [-0.5, -1.5], "stop")
    assert gen.weight_version == "v3"
    spans = [{"version": "v3", "start": 0, "end": 1}, {"version": "v4", "start": 1, "end": 2}]
    assert parse_vllm_reply(_reply(weight_versions=spans)).weight_version == "v3,v4"
    assert parse_vllm_reply(_reply(finish_reason="repetition")).finish_reason == "stop"
    assert parse_vllm_reply(_reply(finish_reason="length")).finish_reason == "length"
    aborted = parse_vllm_reply(_reply(finish_reason="abort", token_ids=[], logprobs=None))
    assert (aborted.output_ids, aborted.finish_reason) == ([], "abort")


def test_a_reply_without_logprobs_or_with_other_ids_is_refused() -> None:
    with pytest.raises(PolicyUnavailable) as bad:
        parse_vllm_reply(_reply(logprobs=None))
    assert bad.value.reason == "POLICY_BAD_REPLY"
    with pytest.raises(ValueError, match="does not follow token_ids"):
        parse_vllm_reply(_reply(token_ids=[5, 9]))
    with pytest.raises(ValueError, match="unknown finish_reason"):
        parse_vllm_reply(_reply(finish_reason="error"))


class CountingProvider:
    """Counts leases; none should be asked for."""

    def __init__(self) -> None:
        self.leases = 0

    def lease(self, *args, **kwargs):
        self.leases += 1
        raise AssertionError("a refused start leased a sandbox")


@pytest.fixture
async def agent():
    provider = CountingProvider()
    server = AgentServer(
        AgentSettings(
            host="127.0.0.1",
            port=0,
            auth_token=TOKEN,
            log_level="warning",
            tokenizer_processes=0,
            gateway_port=0,
        ),
        provider=provider,  # type: ignore[arg-type]
    )
    await server.start()
    channel = make_channel(server.address, token=TOKEN)
    try:
        yield agent_pb2_grpc.AgentServiceStub(channel), provider
    finally:
        await channel.close()
        await server.stop(0)


def _vllm_start(**params) -> pb.EpisodeStart:
    start = start_for(bundled_tasks()[0], "http://127.0.0.1:9", "vllm-check")
    start.policy.api = pb.POLICY_API_VLLM_GENERATE
    start.policy.sampling_params.update(params)
    return start


async def _refused(stub, start: pb.EpisodeStart) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.RunEpisode(iter([pb.RunEpisodeRequest(start=start)]), timeout=30):
            pass
    return caught.value


@pytest.mark.parametrize(
    ("params", "key"),
    [({"frobnicate": 1.0}, "frobnicate"), ({"custom_params": {"a": 1.0}}, "custom_params")],
)
async def test_an_episode_with_an_unknown_vllm_param_is_refused_before_any_lease(
    agent, params, key
) -> None:
    stub, provider = agent
    err = await _refused(stub, _vllm_start(**params))
    reason, metadata = error_info(err)
    assert (err.code(), reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_EPISODE_START")
    assert metadata.get("field") == f"policy.sampling_params.{key}"
    assert f"sampling_params.{key}:" in (err.details() or "")
    assert provider.leases == 0


async def test_a_vllm_episode_needs_a_tokenizer_and_an_unknown_api_is_refused(agent) -> None:
    stub, provider = agent
    start = _vllm_start()
    start.policy.tokenizer_path = ""
    err = await _refused(stub, start)
    assert (err.code(), error_info(err)[0]) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_EPISODE_START",
    )
    assert "tokenizer_path is required for VLLM_GENERATE" in (err.details() or "")
    start = _vllm_start()
    start.policy.api = 9  # type: ignore[assignment]  # no PolicyApi value
    err = await _refused(stub, start)
    reason, metadata = error_info(err)
    assert (err.code(), reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_EPISODE_START")
    assert metadata.get("field") == "policy.api"
    assert provider.leases == 0


async def test_a_vllm_session_with_an_unknown_param_is_refused_at_open(agent) -> None:
    stub, _ = agent
    params = struct_pb2.Struct()
    params.update({"temperature": 1.0, "frobnicate": 3})
    request = pb.OpenSessionRequest(
        request_id="open-vllm",
        policy=pb.PolicyConfig(
            endpoint="http://127.0.0.1:9",
            api=pb.POLICY_API_VLLM_GENERATE,
            tokenizer_path=TOKENIZER_DIR,
            sampling_params=params,
        ),
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.OpenSession(request, timeout=30)
    reason, metadata = error_info(caught.value)
    assert (caught.value.code(), reason) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_SESSION_SPEC",
    )
    assert metadata.get("field") == "policy.sampling_params.frobnicate"
    request.policy.api = pb.POLICY_API_OPENAI_CHAT
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.OpenSession(request, timeout=30)
    assert error_info(caught.value) == (
        "INVALID_SESSION_SPEC",
        {"field": "policy.api"},
    )


async def test_a_vllm_session_on_an_sglang_server_names_the_api_mismatch() -> None:
    """The replay serves SGLang's /generate only: vLLM's route is a 404 there, which the
    session's client answers with 503 naming the mismatch (not retried: the SDK sees one)."""
    async with gateway_env() as env:
        session = await env.open(engine=ENGINE_VLLM)
        async with openai.AsyncOpenAI(
            base_url=env.openai_url(session), api_key=session.secret, max_retries=0
        ) as client:
            with pytest.raises(openai.APIStatusError) as failed:
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"{KEY}: hi"}]
                )
        assert failed.value.status_code == 503
        message = json.dumps(failed.value.body)
        assert "POLICY_ERROR" in message
        assert "policy.api is VLLM_GENERATE" in message
        assert "does not speak vLLM's token API" in message
        assert env.replay.stats.requests_seen == []


def test_the_vllm_tests_skip_without_an_engine_url_and_fail_when_it_is_not_healthy(
    monkeypatch,
) -> None:
    from testkit.vllm_engine import wait_for_engine

    monkeypatch.delenv("SWERL_VLLM_URL", raising=False)
    with pytest.raises(pytest.skip.Exception, match="SWERL_VLLM_URL"):
        wait_for_engine(start_s=1.0)
    monkeypatch.setenv("SWERL_VLLM_URL", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(pytest.fail.Exception, match="is set but the engine is not healthy"):
        wait_for_engine(start_s=1.0)


def test_a_vllm_alone_test_has_the_engine_to_itself(monkeypatch) -> None:
    """engine_turn: while one holder has the engine alone, neither a shared nor another lone
    hold is given (each times out); once it lets go, shared holds are given side by side."""
    from testkit import vllm_engine as kit

    monkeypatch.setenv("SWERL_VLLM_URL", "http://127.0.0.1:1/turn-test")
    monkeypatch.setattr(kit, "TURN_WAIT_S", 0.5)
    with kit.engine_turn(alone=True):
        for alone in (False, True):
            with pytest.raises(TimeoutError, match="no turn on the engine"):
                with kit.engine_turn(alone=alone):
                    pass
    with kit.engine_turn(alone=False), kit.engine_turn(alone=False):
        with pytest.raises(TimeoutError):
            with kit.engine_turn(alone=True):
                pass


async def test_a_cancelled_call_is_aborted_again_on_a_schedule(monkeypatch) -> None:
    """vLLM drops an abort for a request it has not admitted yet, so swerl sends it again: an
    HTTP server on port 0 that never answers /generate counts the aborts (waits shortened)."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from swerl.agent.policy import vllm as vllm_policy
    from swerl.chassis.site import serve_app

    monkeypatch.setattr(vllm_policy, "ABORT_AGAIN_S", (0.0, 0.05, 0.05))
    generating, released = asyncio.Event(), asyncio.Event()
    aborts: list[dict] = []

    async def generate(_: web.Request) -> web.Response:
        generating.set()
        await released.wait()  # the test's end: swerl has long gone
        return web.Response(status=503)

    async def abort(request: web.Request) -> web.Response:
        aborts.append(await request.json())
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post(vllm_policy.GENERATE_PATH, generate)
    app.router.add_post(vllm_policy.ABORT_PATH, abort)
    runner, port = await serve_app(app, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session:
            policy = vllm_policy.VllmPolicy(
                session, f"http://127.0.0.1:{port}", {}, request_timeout_s=60, request_key="ep1"
            )
            call = asyncio.ensure_future(policy.generate([1, 2, 3], 8))
            await asyncio.wait_for(generating.wait(), 10)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            for _ in range(100):
                if len(aborts) == 3:
                    break
                await asyncio.sleep(0.02)
    finally:
        released.set()
        await runner.cleanup()
    assert len(aborts) == 3
    [ids] = {tuple(a["request_ids"]) for a in aborts}
    assert len(ids) == 1 and ids[0].startswith(vllm_policy.ENGINE_REQUEST_PREFIX + "ep1-")
