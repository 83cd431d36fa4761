"""What a trainer needs beside the tokens: one routing key per episode on every policy call
(prefix-cache affinity behind a consistent-hashing router), the kept top-p sets of every
response token (top-p replay) and the routed experts of every token (routing replay)."""

from __future__ import annotations

import asyncio
import base64
import json
from array import array

import pytest
from google.protobuf.struct_pb2 import Struct
from testkit.agent import (
    agent_stack,
    bundled_tasks,
    check_record,
    result_of,
    run_to_result,
    sandboxes_left,
    start_for,
)

from swerl.agent.policy.clients import PolicyUnavailable, SglangPolicy, parse_generate_reply
from swerl.agent.v1 import agent_pb2 as pb
from swerl.devservers.replay import (
    REPLAY_EXPERTS_PER_TOKEN,
    ReplayPolicyServer,
    replay_experts,
    replay_top_p,
    scripts_for_tasks,
)

ROUTING_HEADER = "X-SMG-Routing-Key"


def _reply(meta: dict) -> bytes:
    base = {"output_token_logprobs": [[-0.5, 11, None], [-0.25, 22, None]]}
    return json.dumps(
        {"text": "hi", "meta_info": {**base, "finish_reason": {"type": "stop"}, **meta}}
    ).encode()


def _b64(values: list[int]) -> str:
    return base64.b64encode(array("i", values).tobytes()).decode()


def test_top_p_sets_are_read_from_lists_and_from_base64() -> None:
    listed = _reply({"top_p_token_ids": [11, 12, 22], "top_p_token_offsets": [0, 2, 3]})
    gen = parse_generate_reply(listed, top_p=True)
    assert list(gen.top_p_ids or []) == [11, 12, 22]
    assert list(gen.top_p_offsets or []) == [0, 2, 3]
    packed = _reply(
        {"top_p_kept_token_ids": _b64([11, 22]), "top_p_kept_token_offsets": _b64([0, 1, 2])}
    )
    gen = parse_generate_reply(packed, top_p=True)
    assert list(gen.top_p_ids or []) == [11, 22] and list(gen.top_p_offsets or []) == [0, 1, 2]
    # Not asked for: nothing is read even when the server sends it.
    assert parse_generate_reply(listed).top_p_offsets is None


def test_a_reply_without_the_asked_for_top_p_sets_or_experts_is_a_bad_reply() -> None:
    for kwargs in ({"top_p": True}, {"routed_experts": True}):
        with pytest.raises(PolicyUnavailable) as caught:
            parse_generate_reply(_reply({}), **kwargs)
        assert caught.value.reason == "POLICY_BAD_REPLY"


@pytest.mark.parametrize(
    "offsets", [[0, 2], [1, 2, 3], [0, 2, 4], [0, 3, 2]], ids=["short", "start", "end", "down"]
)
def test_top_p_offsets_that_do_not_frame_the_ids_are_refused(offsets: list[int]) -> None:
    body = _reply({"top_p_token_ids": [11, 12, 22], "top_p_token_offsets": offsets})
    with pytest.raises(ValueError, match="offsets"):
        parse_generate_reply(body, top_p=True)


def test_the_request_asks_for_routed_experts_only_when_told() -> None:
    plain = SglangPolicy(None, "http://h:1", {}, request_timeout_s=5)  # type: ignore[arg-type]
    asked = SglangPolicy(
        None,  # type: ignore[arg-type]
        "http://h:1",
        {},
        request_timeout_s=5,
        return_routed_experts=True,
    )
    assert "return_routed_experts" not in json.loads(plain._body([1, 2], 8))
    assert json.loads(asked._body([1, 2], 8))["return_routed_experts"] is True


@pytest.mark.usefixtures("base_image")
async def test_every_policy_call_of_an_episode_carries_its_own_routing_key() -> None:
    tasks = bundled_tasks()[:2]
    replay = ReplayPolicyServer(scripts_for_tasks(tasks, "gold"))
    url = await replay.start()
    try:
        async with agent_stack() as env:
            starts = [start_for(t, url, f"routing-{i}") for i, t in enumerate(tasks)]
            runs = await asyncio.gather(*(run_to_result(env.stub, s) for s in starts))
    finally:
        await replay.stop()
    results = [result_of(messages) for messages in runs]
    assert [r.status for r in results] == [pb.EPISODE_STATUS_SUBMITTED] * 2
    keys_by_script: dict[str | None, set[str | None]] = {}
    for call in replay.stats.calls:
        keys_by_script.setdefault(call.script_key, set()).add(call.headers.get(ROUTING_HEADER))
    assert len(replay.stats.calls) == sum(r.metrics["turns"] for r in results)
    assert sorted(keys_by_script.values(), key=sorted) == [{"routing-0"}, {"routing-1"}]
    assert sandboxes_left() == []


def _span(record: pb.TokenRecord, i: int) -> list[int]:
    offsets = record.top_p_token_offsets
    return list(record.top_p_token_ids[offsets[i] : offsets[i + 1]])


def check_replay_extras(record: pb.TokenRecord) -> None:
    """The record's top-p sets and routed experts are exactly what the replay server sent."""
    n = len(record.response_ids)
    assert len(record.top_p_token_offsets) == n + 1
    assert record.top_p_token_offsets[0] == 0
    assert record.top_p_token_offsets[-1] == len(record.top_p_token_ids)
    position = 0
    for i, (mask, token) in enumerate(zip(record.loss_mask, record.response_ids, strict=True)):
        if mask == 0:
            assert _span(record, i) == []
            position = 0
        else:
            assert _span(record, i) == replay_top_p(position, token)
            position += 1
    sequence = [*record.prompt_ids, *record.response_ids][:-1]
    assert record.routed_experts_per_token == REPLAY_EXPERTS_PER_TOKEN
    experts = array("i")
    experts.frombytes(record.routed_experts)
    assert list(experts) == [e for t in sequence for e in replay_experts(t)]


@pytest.mark.usefixtures("base_image")
async def test_top_p_sets_and_routed_experts_reach_every_record() -> None:
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer(scripts_for_tasks([task], "gold"))
    url = await replay.start()
    results = []
    try:
        async with agent_stack() as env:
            for dynamic in (False, True):
                start = start_for(task, url, f"replay-extras-{dynamic}", dynamic_history=dynamic)
                params = Struct()
                params.update({"top_p": 0.9, "custom_params": {"return_top_p_token_ids": True}})
                start.policy.sampling_params.CopyFrom(params)
                start.policy.return_routed_experts = True
                results.append(result_of(await run_to_result(env.stub, start)))
    finally:
        await replay.stop()
    whole, per_turn = results
    assert whole.status == per_turn.status == pb.EPISODE_STATUS_SUBMITTED
    check_record(whole.trajectory, replay)
    check_replay_extras(whole.trajectory)
    assert len(per_turn.turns) == 4
    for record in per_turn.turns:
        check_record(record, replay)
        check_replay_extras(record)
    assert sandboxes_left() == []


@pytest.mark.usefixtures("base_image")
async def test_records_carry_no_replay_extras_unless_asked() -> None:
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer(scripts_for_tasks([task], "gold"))
    url = await replay.start()
    try:
        async with agent_stack() as env:
            result = result_of(await run_to_result(env.stub, start_for(task, url, "plain")))
    finally:
        await replay.stop()
    record = result.trajectory
    assert result.status == pb.EPISODE_STATUS_SUBMITTED
    assert not record.top_p_token_ids and not record.top_p_token_offsets
    assert not record.routed_experts and record.routed_experts_per_token == 0
