"""The trainer-plugin tests' framework under test and what they build for it: the stand-in
(slime_standin or miles_standin, chosen by SWERL_TEST_FRAMEWORK, slime by default; CI runs
tests/trainer_plugin once with each: scripts/test), the args slime's RolloutManager has, samples
as the data source makes them, and the sampling params SGLang is sent."""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

from swerl.chassis.hf import bundled_qwen3_tokenizer_dir
from testkit import miles_standin, slime_standin

STANDINS = {"slime": slime_standin, "miles": miles_standin}
FRAMEWORK = os.environ.get("SWERL_TEST_FRAMEWORK", "slime")
if FRAMEWORK not in STANDINS:
    raise RuntimeError(f"SWERL_TEST_FRAMEWORK must be one of {sorted(STANDINS)}, not {FRAMEWORK!r}")


def accepted_estimators(candidates: tuple[str, ...] | list[str]) -> list[str]:
    """The candidates the framework in use accepts as --advantage-estimator (miles refuses
    cispo), so a test is parametrized over what this run can ask of it, never skipped."""
    accepted = getattr(STANDINS[FRAMEWORK], "ADVANTAGE_ESTIMATORS", tuple(candidates))
    return [e for e in candidates if e in accepted]


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


def make_sample(group_index: int = 0, index: int = 0, standin: Any = None, **instance: Any) -> Any:
    """A sample of the framework under test (or of `standin`), as its data source makes it."""
    row = {**copy.deepcopy(INSTANCE), **instance}
    return (standin or STANDINS[FRAMEWORK]).Sample(
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
        # The frameworks' GenerateState loads its tokenizer from here.
        hf_checkpoint=str(bundled_qwen3_tokenizer_dir()),
        rollout_max_context_len=16384,
        rollout_max_response_len=4096,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        rollout_stop=None,
        rollout_stop_token_ids=[151645],
        rollout_skip_special_tokens=False,
        n_samples_per_prompt=4,
        n_samples_per_eval_prompt=1,  # the frameworks' default
        rollout_batch_size=2,
        global_batch_size=8,
        advantage_estimator="grpo",
        rewards_normalization=True,
        grpo_std_normalization=True,
        reward_key=None,
        use_rollout_routing_replay=False,
        rollout_function_path=None,
        custom_generate_function_path=None,
        custom_rm_path="swerl.trainer_plugin.reward_func",
        custom_rollout_log_function_path="swerl.trainer_plugin.log_rollout_data",
        custom_eval_rollout_log_function_path="swerl.trainer_plugin.log_eval_rollout_data",
        dynamic_sampling_filter_path="swerl.trainer_plugin.filter_infra_failures",
        custom_reward_post_process_path="swerl.trainer_plugin.post_process_rewards",
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
