"""The plugin passes the episode's LoRA adapter to the agent (issue 23, item 1): miles names
"miles_lora" on every `/generate` when LoRA is on for the rollout, the slot's adapter under
multi-LoRA (miles rollout/sglang_rollout.py:184-200, generate_endpoint_utils.py:72-73); slime
has no LoRA flags. Without it every miles LoRA episode was sampled from the base model."""

from __future__ import annotations

import pytest
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


async def test_a_multi_lora_sample_samples_from_its_slots_adapter(fw, sampling_params) -> None:
    agent = PlaybackAgent(lambda start: Scenario(result=result(start)))
    sample = make_sample()
    if fw.NAME == "miles":
        sample.adapter = fw.AdapterRef(name="team-a", slot=3)
    async with PlaybackServer(agent) as server:
        args = make_args([server.address])
        args.lora_rank = 8
        await fw.generate(args, sample, sampling_params)
    (start,) = agent.starts
    # miles: the slot's engine-side name (utils/multi_lora.py:191-194); slime has no adapters.
    assert start.policy.lora_path == ("__miles_slot_3" if fw.NAME == "miles" else "")
