"""Reward normalisation per prompt group, with every episode counted once.

slime's default post-process reshapes the rewards to `n_samples_per_prompt` columns, which is
only right when every generate call returned exactly one sample. With dynamic history an episode
returns one sample per turn, and long episodes would outweigh short ones in the group baseline
(or, when the counts do not divide, slime normalises over the whole batch). Here:

- samples are grouped by `group_index` (the prompt), and within a group by `rollout_id` (the
  episode);
- each episode contributes one value to the group's statistics: the mean reward of its samples
  (with PRM shaping the turns differ; without it every turn carries the outcome reward);
- each sample's normalised reward is `(reward - group_mean) / (group_std + 1e-6)` (std only for
  grpo, gspo and cispo with `grpo_std_normalization`, as in slime; the std is the unbiased one,
  like torch's default);
- samples marked `remove_sample` (placeholders) take no part in the statistics and get 0.0;
- a branching group's trunk turns (`metadata["branch_trunk"]`, see branching.py) are each
  member's own copy, with that branch's rewards: part of that member's episode like any turn.

The normalisation applies to the estimators the framework in use normalises when
`rewards_normalization` is on; otherwise raw rewards pass through, as in the framework. slime:
grpo, gspo and cispo centred and divided by the std, reinforce_plus_plus_baseline centred only;
miles: grpo and gspo divided by the std, reinforce_plus_plus_baseline centred (cispo is no
miles estimator: its parser refuses it). With one sample per episode and whole groups this is
exactly slime's computation; miles' own (radixark/miles 31f1ca96,
miles/ray/rollout/train_data_conversion.py) also groups by `group_index` and counts each rollout
once, so it agrees for uneven groups and multi-sample episodes too (while an episode's samples
share one reward, which miles requires). A group of one episode, or one whose episodes all
score alike, normalises to 0 (miles skips the division there; slime gives NaN for one).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from swerl.trainer_plugin.metrics import episode_key, flatten

# Per framework: (estimators normalised at all, estimators also divided by the std).
ESTIMATORS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "slime": (("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline"), ("grpo", "gspo", "cispo")),
    "miles": (("grpo", "gspo", "reinforce_plus_plus_baseline"), ("grpo", "gspo")),
}
EPSILON = 1e-6


def reward_value(args: Any, sample: Any) -> float:
    """The scalar reward of a sample, honouring slime's `--reward-key` for dict rewards."""
    getter = getattr(sample, "get_reward_value", None)
    if callable(getter):
        return float(getter(args))
    reward = sample.reward
    key = getattr(args, "reward_key", None)
    if key and isinstance(reward, dict):
        reward = reward[key]
    return float(reward)


def normalise(
    args: Any, samples: Sequence[Any], framework: str = "slime"
) -> tuple[list[float], list[float]]:
    """(raw_rewards, rewards) for the framework's flattened samples, both as long as `samples`."""
    flat = flatten(samples)
    raw = [reward_value(args, s) for s in flat]
    estimator = getattr(args, "advantage_estimator", "grpo")
    normalised, std_divided = ESTIMATORS[framework]
    if estimator not in normalised or not getattr(args, "rewards_normalization", True):
        return raw, list(raw)
    divide_by_std = estimator in std_divided and getattr(args, "grpo_std_normalization", True)

    groups: dict[Any, dict[Any, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, sample in enumerate(flat):
        if getattr(sample, "remove_sample", False):
            continue
        group_index = getattr(sample, "group_index", None)
        groups[group_index][episode_key(sample)].append(i)

    rewards = [0.0] * len(flat)
    for group in groups.values():
        episode_values = [sum(raw[i] for i in idx) / len(idx) for idx in group.values()]
        mean = sum(episode_values) / len(episode_values)
        std = _unbiased_std(episode_values, mean) if divide_by_std else 0.0
        for i in (i for idx in group.values() for i in idx):
            centred = raw[i] - mean
            rewards[i] = centred / (std + EPSILON) if divide_by_std else centred
    return raw, rewards


def _unbiased_std(values: Sequence[float], mean: float) -> float:
    if len(values) < 2:
        return 0.0  # torch gives nan here; one episode has no spread to divide by
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
