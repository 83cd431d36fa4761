"""SGLang's `rid` and `extra_key` on every policy call (issue 41 point 1): with
PolicyConfig.request_id_prefix each call's rid is the prefix and a fresh 32-hex id (miles'
make_rid, so its abort by rid prefix reaches the call), with cache_key each call's extra_key is
the key (the prefix cache's namespace: miles' "<adapter>:v<version>"); neither is sent when
unset, and neither is accepted for an engine other than SGLang."""

from __future__ import annotations

import re
from array import array

import aiohttp
import pytest

from swerl.agent.gateway.errors import InvalidSessionSpec
from swerl.agent.gateway.wire import spec_of
from swerl.agent.policy.clients import SglangPolicy
from swerl.agent.v1 import agent_pb2 as pb
from swerl.devservers.replay import ReplayPolicyServer


async def _calls(**options: str) -> list:
    replay = ReplayPolicyServer({})
    url = await replay.start()
    try:
        async with aiohttp.ClientSession() as session:
            policy = SglangPolicy(session, url, {}, request_timeout_s=30, **options)
            for n in (8, 12):
                await policy.generate(array("i", range(1, n)), 4)
    finally:
        await replay.stop()
    return replay.stats.calls


async def test_every_call_carries_a_fresh_rid_under_the_prefix_and_the_cache_key() -> None:
    calls = await _calls(request_id_prefix="team-a::", cache_key="team-a:v7")
    rids = [call.rid for call in calls]
    assert all(re.fullmatch(r"team-a::[0-9a-f]{32}", rid or "") for rid in rids), rids
    assert len(set(rids)) == 2, "a fresh rid per call"
    assert [call.extra_key for call in calls] == ["team-a:v7", "team-a:v7"]


async def test_without_them_no_rid_and_no_extra_key_are_sent() -> None:
    calls = await _calls()
    assert [(call.rid, call.extra_key) for call in calls] == [(None, None), (None, None)]


@pytest.mark.parametrize("name", ["request_id_prefix", "cache_key"])
def test_a_gateway_session_on_vllm_refuses_sglangs_request_tags(name: str) -> None:
    policy = pb.PolicyConfig(api=pb.POLICY_API_VLLM_GENERATE, tokenizer_path="/t")
    setattr(policy, name, "team-a")
    with pytest.raises(InvalidSessionSpec) as refused:
        spec_of(pb.OpenSessionRequest(policy=policy))
    assert refused.value.reason == "INVALID_SESSION_SPEC"
    assert refused.value.metadata.get("field") == f"policy.{name}"
