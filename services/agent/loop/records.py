"""An episode's token records, written into its final message: what the trainer learns from.

One record per chain of a harness episode's gateway session; one per turn in dynamic-history mode;
else one per chain of the policy's conversation, each with the episode's reward (a lone chain,
no trim, stays in `trajectory`, where readers that predate chains find it). Built in the agent's
CPU pool: a long episode's records hold hundreds of thousands of ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from swerl.agent.policy.modes import Policy
from swerl.agent.policy.tokens import TokenRecordData
from swerl.agent.v1 import agent_pb2 as pb

# The reward a record carries: (outcome reward, turn index or None for a chain) -> reward.
Shaped = Callable[[float | None, int | None], float | None]


def fill_records(
    result: pb.EpisodeResult,
    policy: Policy,
    *,
    reward: float | None,
    shaped: Shaped,
    dynamic_history: bool,
    harness_records: Sequence[TokenRecordData] | None,
) -> None:
    """Writes the episode's records into `result`; `harness_records` is a harness episode's
    (None for swerl's own loop, whose records are the policy's)."""
    if harness_records is not None:
        # A harness episode: one sample per chain of its gateway session.
        fill_chains(result, harness_records, shaped(reward, None))
    elif dynamic_history:
        for index, record in enumerate(policy.turn_records()):
            fill_record(result.turns.add(), record, shaped(reward, index))
    else:
        fill_chains(result, policy.whole_records(), shaped(reward, None))


def fill_chains(
    result: pb.EpisodeResult, records: Sequence[TokenRecordData], reward: float | None
) -> None:
    """One record per chain; a lone chain goes in `trajectory`."""
    if len(records) == 1:
        fill_record(result.trajectory, records[0], reward)
    else:
        for record in records:
            fill_record(result.chains.add(), record, reward)


def fill_record(message: pb.TokenRecord, record: TokenRecordData, reward: float | None) -> None:
    """One checked record, appended field by field into its message (no copy of the ids)."""
    record.check()
    message.prompt_ids.extend(record.prompt_ids)
    message.response_ids.extend(record.response_ids)
    message.loss_mask.extend(record.loss_mask)
    message.logprobs.extend(record.logprobs)
    message.weight_versions.extend(record.weight_versions)
    message.top_p_token_ids.extend(record.top_p_token_ids)
    message.top_p_token_offsets.extend(record.top_p_token_offsets)
    if record.routed_experts:
        message.routed_experts = record.routed_experts
        message.routed_experts_per_token = record.experts_per_token
    message.cached_tokens = record.cached_tokens
    message.engine_prompt_tokens = record.engine_prompt_tokens
    if reward is not None:
        message.reward = reward
