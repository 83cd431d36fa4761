"""The plugin passes the episode's LoRA adapter to the agent (issue 23, item 1): miles names
"miles_lora" on every `/generate` when LoRA is on for the rollout, the slot's adapter under
multi-LoRA (miles rollout/sglang_rollout.py:184-200, generate_endpoint_utils.py:72-73); slime
has no LoRA flags. Without it every miles LoRA episode was sampled from the base model."""

from __future__ import annotations

import pytest
from testkit import miles_standin
from testkit.playback import PlaybackAgent, PlaybackServer, Scenario, result
from testkit.plugin import make_args, make_sample

pytestmark = pytest.mark.usefixtures("fw")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({}, ""),
        ({"lora_rank": 16}, "miles_lora"),
        ({"lora_adapter_path": "/ckpt/adapter"}, "miles_lora"),
        ({"lora_rank": 16, "lora_train_only": True}, ""),
    ],
)
async def test_the_episode_samples_from_the_runs_lora_adapter(
    fw, sampling_params, flags, expected
) -> None:
    agent = PlaybackAgent(lambda start: Scenario(result=result(start)))
    async with PlaybackServer(agent) as server:
        args = make_args([server.address])
        for key, value in flags.items():
            setattr(args, key, value)
        await fw.generate(args, make_sample(), sampling_params)
    (start,) = agent.starts
    assert start.policy.lora_path == (expected if fw.NAME == "miles" else "")


def _sampleable(fw, name: str, slot: int, version: int) -> None:
    """Puts the adapter in miles' controller snapshot, as registered and active."""
    cache = fw.AdaptersCache()
    cache.snapshot["active"][name] = fw.AdapterRun(name=name, slot=slot, version=version)


async def test_a_multi_lora_sample_samples_from_its_slots_adapter(fw, sampling_params) -> None:
    agent = PlaybackAgent(lambda start: Scenario(result=result(start)))
    sample = make_sample()
    if fw.NAME == "miles":
        sample.adapter = fw.AdapterRef(name="team-a", slot=3)
        _sampleable(fw, "team-a", 3, version=7)
    async with PlaybackServer(agent) as server:
        args = make_args([server.address])
        args.lora_rank = 8
        await fw.generate(args, sample, sampling_params)
    (start,) = agent.starts
    # miles: the slot's engine-side name (utils/multi_lora.py:191-194); slime has no adapters.
    assert start.policy.lora_path == ("__miles_slot_3" if fw.NAME == "miles" else "")


async def test_a_multi_lora_episodes_calls_carry_miles_rid_prefix_and_cache_key(
    fw, sampling_params
) -> None:
    """Issue 41 point 1: miles sends `rid` = make_rid(adapter) and `extra_key` =
    "<adapter>:v<version>" on every slot /generate (rollout/sglang_rollout.py:184-198): its
    retire and free-slot aborts match rids by the "<adapter>::" prefix, and the key keeps a slot
    reloaded in place from serving this episode from the previous weights' prefix cache. slime
    has neither (no adapters)."""
    agent = PlaybackAgent(lambda start: Scenario(result=result(start)))
    sample = make_sample()
    if fw.NAME == "miles":
        sample.adapter = fw.AdapterRef(name="team-a", slot=3)
        _sampleable(fw, "team-a", 3, version=7)
    async with PlaybackServer(agent) as server:
        args = make_args([server.address])
        args.lora_rank = 8
        await fw.generate(args, sample, sampling_params)
    (start,) = agent.starts
    expected = ("team-a::", "team-a:v7") if fw.NAME == "miles" else ("", "")
    assert (start.policy.request_id_prefix, start.policy.cache_key) == expected


async def test_a_sample_whose_adapter_left_the_controller_runs_no_episode(
    fw, sampling_params
) -> None:
    """miles drops the generation of an adapter no longer sampleable (it would keep decoding
    under the slot's next tenant, rollout/sglang_rollout.py:184-193): the plugin starts no
    episode and answers ABORTED. slime knows no adapters: its episode runs."""
    agent = PlaybackAgent(lambda start: Scenario(result=result(start)))
    sample = make_sample()
    sample.adapter = miles_standin.AdapterRef(name="retired", slot=1)
    async with PlaybackServer(agent) as server:
        args = make_args([server.address])
        args.lora_rank = 8
        out = await fw.generate(args, sample, sampling_params)
    (got,) = out if isinstance(out, list) else [out]
    if fw.NAME == "miles":
        assert agent.starts == []
        assert got.status == fw.Sample.Status.ABORTED
        assert got.metadata["error_reason"] == "ADAPTER_NOT_SAMPLEABLE"
    else:
        assert len(agent.starts) == 1
        assert got.status != fw.Sample.Status.ABORTED
