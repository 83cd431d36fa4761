"""What the two framework stand-ins (slime_standin, miles_standin) share: the checks of what the
trainer asserts or silently depends on (SLIME_CONTRACT.md), the tokenizer loader, the metrics
logger, and the hook loader. Written for swerl's tests; no framework code is copied.
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Any

# What the frameworks' loggers were asked to log: (step_key, metrics) per call.
LOGGED: list[tuple[str, dict[str, Any]]] = []

_tokenizers: dict[str, Any] = {}


def load_tokenizer(path: str, **_: Any) -> Any:
    """The frameworks' tokenizer loader: the HF tokenizer in `path` (cached per path, as the
    frameworks load it once per process through their GenerateState)."""
    if path not in _tokenizers:
        from transformers import AutoTokenizer

        _tokenizers[path] = AutoTokenizer.from_pretrained(path)
    return _tokenizers[path]


def log(args: Any, metrics: dict[str, Any], step_key: str) -> None:
    """The frameworks' metrics logger (wandb / tensorboard): records, and needs the step."""
    assert step_key in metrics, f"{step_key} missing from {sorted(metrics)}"
    LOGGED.append((step_key, dict(metrics)))


def compute_rollout_step(args: Any, rollout_id: int) -> int:
    if getattr(args, "wandb_always_use_train_step", False):
        per_rollout = args.rollout_batch_size * args.n_samples_per_prompt
        return rollout_id * per_rollout // args.global_batch_size
    return rollout_id


@dataclass
class PrefixCacheInfo:
    """Stand-in of both frameworks' Sample.PrefixCacheInfo (slime utils/types.py:194-217,
    miles utils/types.py:125): the cached and total prompt tokens of a sample's engine calls."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0


def prefix_cache_metrics(samples: list[Any]) -> dict[str, float]:
    """Both frameworks' rollout prefix-cache metrics over the flattened samples (slime
    observability/rollout_metrics.py:202-210, miles ray/rollout/metrics.py:209-216)."""
    cached = sum(s.prefix_cache_info.cached_tokens for s in samples)
    total = sum(s.prefix_cache_info.total_prompt_tokens for s in samples)
    return {
        "prefix_cache_hit_rate": cached / total if total > 0 else 0.0,
        "avg_cached_tokens_per_sample": cached / len(samples) if samples else 0.0,
    }


def flat_samples(node: Any) -> list[Any]:
    """A rollout's nested samples, flattened as the frameworks flatten them."""
    if isinstance(node, list):
        return [s for item in node for s in flat_samples(item)]
    return [node]


def compute_pass_rate(flat_rewards: list[Any], group_size: int) -> dict[str, float]:
    """The frameworks' pass@k over an eval dataset's rewards: reshaped into groups of
    `group_size` (the run's `n_samples_per_eval_prompt`), asserting `len == groups x n`
    (slime `observability/metric_utils.py:14-40`, the assert at :27; miles
    `utils/metric_utils.py:24`), a group's correct count being its rewards equal to 1."""
    if group_size == 1:
        return {}
    groups = len(flat_rewards) // group_size
    assert len(flat_rewards) == groups * group_size, (len(flat_rewards), groups, group_size)
    out: dict[str, float] = {}
    k = 1
    while k <= group_size:
        estimates = []
        for g in range(groups):
            block = flat_rewards[g * group_size : (g + 1) * group_size]
            correct = sum(r == 1 for r in block)
            if group_size - correct < k:
                estimates.append(1.0)
            else:
                estimates.append(
                    1.0 - math.comb(group_size - correct, k) / math.comb(group_size, k)
                )
        out[f"pass@{k}"] = sum(estimates) / len(estimates) if estimates else float("nan")
        k *= 2
    return out


def load_function(path: str | None) -> Any:
    """Both frameworks' `load_function`: a dotted path to an attribute."""
    if not path:
        return None
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def declares_evaluation(fn: Any) -> bool:
    return "evaluation" in inspect.signature(fn).parameters


def check_sample_invariants(sample_cls: type, sample: Any) -> None:
    """What the trainer asserts or relies on, for one returned sample."""
    assert isinstance(sample, sample_cls), type(sample)
    prompt_len = len(sample.tokens) - sample.response_length
    assert prompt_len >= 1, "prompt must have at least one token"
    assert sample.response_length >= 1, "response must have at least one token"
    assert sample.loss_mask is not None and len(sample.loss_mask) == sample.response_length
    assert sample.rollout_log_probs is not None
    assert len(sample.rollout_log_probs) == sample.response_length
    assert set(sample.loss_mask) <= {0, 1}
    for mask, logprob in zip(sample.loss_mask, sample.rollout_log_probs, strict=True):
        if mask == 0:
            assert logprob == 0.0, "masked tokens carry logprob 0.0"
        assert isinstance(logprob, float)
    assert sample.reward is not None, "every returned sample needs a reward"
    status = sample_cls.Status
    assert sample.status in (status.COMPLETED, status.TRUNCATED, status.ABORTED, status.FAILED)
    if sample.remove_sample:
        assert sample.reward == 0.0 and set(sample.loss_mask) == {0}
    assert isinstance(sample.metadata.get("rollout_id"), int), "the episode's id in metadata"
    assert sample.rollout_id is None or sample.rollout_id == sample.metadata["rollout_id"]
    for key in ("agent_metrics", "eval_report", "episode_status", "patch", "artifact_dir"):
        assert key in sample.metadata, key


def check_call_result(
    sample_cls: type, result: Any, *, per_turn: bool, chains: int = 1
) -> list[Any]:
    """A generate return value: always a list in dynamic mode; otherwise one Sample, or a list
    of `chains` samples when the context was trimmed. Siblings of a list of two or more share
    a non-None rollout_id (the frameworks' fan-out check, see `check_rollout_ids`); a lone
    sample carries none (miles would take it as compact). Returns the samples."""
    if per_turn or chains > 1:
        assert isinstance(result, list) and result, result
        samples = result
        if chains > 1:
            assert len(samples) == chains, (len(samples), chains)
    else:
        assert isinstance(result, sample_cls), type(result)
        samples = [result]
    if len(samples) > 1:
        ids = {s.rollout_id for s in samples}
        assert len(ids) == 1 and None not in ids, f"siblings share a rollout_id: {ids}"
    else:
        assert samples[0].rollout_id is None, "a lone sample sets no rollout_id"
    for sample in samples:
        check_sample_invariants(sample_cls, sample)
    return samples


def check_rollout_ids(node: Any, sample_cls: type, depth: int = 0) -> None:
    """Both frameworks' walk over a rollout's nested output (slime
    observability/rollout_data_utils.py:92-121 `validate_rollout_id_annotated`, called at
    ray/rollout.py:601; miles ray/rollout/rollout_data_conversion.py:54-72
    `validate_compact_rollout_ids`): a list of two or more samples at depth >= 2 (one generate
    call's fan-out) must share one non-None rollout_id."""
    if isinstance(node, sample_cls):
        return
    assert isinstance(node, list), type(node)
    if node and isinstance(node[0], sample_cls):
        if depth >= 2 and len(node) > 1:
            ids = [s.rollout_id for s in node]
            assert None not in ids, f"compact rollout with rollout_id unset: {ids}"
            assert len(set(ids)) == 1, f"siblings must share rollout_id: {ids}"
        return
    for item in node:
        check_rollout_ids(item, sample_cls, depth + 1)


def rollout_mask_sums(rollout_ids: list[Any], loss_masks: list[list[int]]) -> list[int]:
    """The loss reducer's per-rollout denominators: every sample carries the loss-mask total of
    all samples sharing its rollout_id (slime ray/rollout.py:695-700, miles
    ray/rollout/train_data_conversion.py:162-169)."""
    totals: dict[Any, int] = {}
    for rid, mask in zip(rollout_ids, loss_masks, strict=True):
        totals[rid] = totals.get(rid, 0) + sum(mask)
    return [totals[rid] for rid in rollout_ids]


def group_post_process(
    args: Any, samples: list[Any], normalised: tuple[str, ...], std_divided: tuple[str, ...]
) -> tuple[list[float], list[float]]:
    """slime's default reward post-process: rows of n_samples_per_prompt when the batch is
    complete, else one row; each row's mean subtracted; divided by (unbiased std + 1e-6) for the
    std estimators (NaN for a row of one). `normalised`/`std_divided` are its estimator lists.
    miles' differs (per group index and rollout): miles_standin.default_post_process."""
    raw = [s.get_reward_value(args) for s in samples]
    if args.advantage_estimator not in normalised or not args.rewards_normalization:
        return raw, raw
    width = args.n_samples_per_prompt
    if len(raw) != width * args.rollout_batch_size:
        width = len(raw)
    out: list[float] = []
    for start in range(0, len(raw), width):
        row = raw[start : start + width]
        mean = sum(row) / len(row)
        centred = [r - mean for r in row]
        if args.advantage_estimator in std_divided and args.grpo_std_normalization:
            std = (
                math.sqrt(sum(c * c for c in centred) / (len(row) - 1))
                if len(row) > 1
                else math.nan
            )
            centred = [c / (std + 1e-6) for c in centred]
        out.extend(centred)
    return raw, out
