"""Fixtures of the trainer-plugin tests: slime's stand-in, slime-like args, playback agents."""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

import pytest
import slime_standin


@pytest.fixture
def slime(monkeypatch: pytest.MonkeyPatch) -> Any:
    """slime's Sample / GenerateState / DynamicFilterOutput stand-in under slime's names."""
    slime_standin.install(monkeypatch)
    for name in [k for k in os.environ if k.startswith("SWERL_PLUGIN_")]:
        monkeypatch.delenv(name, raising=False)
    return slime_standin


INSTANCE = {
    "instance_id": "swerl-examples__listutils-14",
    "repo": "swerl-examples/listutils",
    "version": "0.1",
    "base_commit": "abc123",
    "problem_statement": "chunk() drops the last partial chunk",
    "FAIL_TO_PASS": '["tests/test_chunk.py::test_partial"]',
    "PASS_TO_PASS": ["tests/test_chunk.py::test_even"],
    "test_patch": "diff --git a/tests/test_chunk.py b/tests/test_chunk.py\n",
    "created_at": "2024-01-01T00:00:00Z",
    "difficulty": 2,
}


def make_sample(group_index: int = 0, index: int = 0, **instance: Any) -> Any:
    row = {**copy.deepcopy(INSTANCE), **instance}
    return slime_standin.Sample(
        group_index=group_index,
        index=index,
        prompt=row["problem_statement"],
        label=None,
        metadata={"instance": row, "data_source": "SWE-Gym/SWE-Gym"},
    )


def make_args(addresses: list[str], **plugin: Any) -> argparse.Namespace:
    """slime's args as the RolloutManager has them, plus `swerl_*` custom-config keys."""
    args = argparse.Namespace(
        sglang_router_ip="127.0.0.1",
        sglang_router_port=30000,
        hf_checkpoint="/models/qwen3-8b",
        rollout_max_context_len=16384,
        n_samples_per_prompt=4,
        rollout_batch_size=2,
        advantage_estimator="grpo",
        rewards_normalization=True,
        grpo_std_normalization=True,
        reward_key=None,
        swerl_agent_addresses=addresses,
        swerl_abort_poll_interval_s=0.02,
        swerl_cancel_grace_s=0.5,
        swerl_connect_attempts=2,
    )
    for key, value in plugin.items():
        setattr(args, "swerl_" + key, value)
    return args


SAMPLING_PARAMS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_new_tokens": 4096,
    "stop": None,
    "stop_token_ids": [151645],
    "skip_special_tokens": False,
    "no_stop_trim": True,
    "spaces_between_special_tokens": False,
}


@pytest.fixture
def sampling_params() -> dict[str, Any]:
    return copy.deepcopy(SAMPLING_PARAMS)
