"""Framework flag combinations the plugin's samples cannot go through, refused before any
episode runs (issue 23, items 4 and 5).

Each refusal is one line naming the flags. The facts (slime 624b824a, miles 31f1ca96):

- `--partial-rollout` reads `.response` of every entry of a group (slime
  rollout/sglang_rollout.py:360-364; miles inference_rollout_train.py:44-47): a list entry (one
  sample per turn, dynamic history) crashes it at the end of the rollout.
- slime's `--log-passrate` asserts `len(raw_reward) == rollout_batch_size x n`
  (observability/train_metric_utils.py:238-239): one sample per turn breaks it.
- miles' `--recompute-logprobs-via-prefill` iterates the group's samples and reads
  `response_length` (inference_rollout_train.py:178-183, prefill_logprobs.py:147-149).
- miles treats a batch carrying `rollout_id` as compact and then computes no dynamic global
  batch size (ray/rollout/rollout_data_conversion.py:30-41), which
  `--use-dynamic-global-batch-size` asserts on (train_data_conversion.py:154-155); multi-LoRA
  turns it on (utils/multi_lora.py:179). Lists of samples need a shared `rollout_id`
  (rollout_data_conversion.py:54-72), so no call may return one there.
- miles' `--use-rollout-indexer-replay` needs `Sample.rollout_indexer_topk`, which swerl's
  agent does not return.
- `--group-rm` scores each finished group with a reward model and writes `sample.reward` over
  swerl's verdict (slime rollout/sglang_rollout.py:330-334; miles rollout/sglang_rollout.py
  :384-388), or asserts it is still None (miles rollout/rm_hub/__init__.py:97-101, which the
  inference rollout's group path calls): refused (issue 41 point 9).
- `--reward-key` / `--eval-reward-key` index `sample.reward` by the key (slime
  utils/types.py:247 and rollout/sglang_rollout.py:617-620; miles utils/types.py:178 and
  rollout/sglang_rollout.py:663-666): swerl's reward is one float, so that indexing raises.
- `--sglang-allow-auto-truncate` makes SGLang cut a prompt over its context length (or its KV
  pool's size) instead of refusing it (sglang 0.5.23 srt/managers/utils.py:272-280): with an
  episode budget above the engine's context, the engine samples on a prompt swerl did not record,
  silently (issue 41 point 8; `auto_truncate_refusal`).

- Without `--use-dynamic-batch-size`, each train step's micro-batches must number a multiple
  of dp x the micro-batch group (slime utils/dp_schedule.py:125 and :169-185; miles
  utils/dp_schedule.py:47 and :124-132 raise otherwise): a list of samples per episode makes a
  step's sample count vary, so at a data-parallel size over 1 dynamic history is refused and
  chains are not returned as lists (issue 41 point 4; `static_alignment`).

- slime trains a list of samples sharing a `rollout_id` as one rollout only from v0.3.1 on,
  whose loss divides each rollout's token sum by its own mask total (`rollout_mask_sums`:
  backends/megatron_utils/data.py, ray/rollout.py). v0.2.2 to v0.3.0 reduce per sample and
  v0.2.x trims the batch by sample count (v0.2.4 ray/rollout.py:591-602): every list would be
  over-weighted and the batch's tail dropped. There dynamic history is refused and chains are
  not returned as lists (issue 41 point 2; `slime_rollout_reducer`).

Where lists are refused, a whole trajectory whose context was trimmed (several chains) gives
its last chain alone (`lists_allowed`): the earlier chains are not trained on, never mixed in.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any


def _on(args: Any, name: str) -> bool:
    return bool(getattr(args, name, False))


def _dynamic_gbs_flag(args: Any) -> str | None:
    """The flag that makes miles compute a dynamic global batch size, if any."""
    if _on(args, "multi_lora"):
        return "--multi-lora (which turns on --use-dynamic-global-batch-size)"
    if _on(args, "use_dynamic_global_batch_size"):
        return "--use-dynamic-global-batch-size"
    return None


def _size(args: Any, name: str, default: int = 1) -> int:
    value = getattr(args, name, None)
    return int(value) if isinstance(value, int) and value > 0 else default


def static_alignment(args: Any) -> int:
    """What each train step's micro-batch count must be a multiple of under the frameworks'
    static micro-batches: the data-parallel size (the actor's GPUs over tensor x pipeline x
    context parallelism, as Megatron's data-parallel group without context parallelism), times
    the micro-batch group per virtual pipeline stage when there is more than one (Megatron's
    default group is the pipeline size). 1 with `--use-dynamic-batch-size`, whose bins the
    frameworks split to fit."""
    if _on(args, "use_dynamic_batch_size"):
        return 1
    world = _size(args, "actor_num_nodes") * _size(args, "actor_num_gpus_per_node")
    pipeline = _size(args, "pipeline_model_parallel_size")
    model = _size(args, "tensor_model_parallel_size") * pipeline
    dp = max(world // (model * _size(args, "context_parallel_size")), 1)
    if _size(args, "virtual_pipeline_model_parallel_size") > 1:
        return dp * _size(args, "microbatch_group_size_per_vp_stage", pipeline)
    return dp


@functools.lru_cache(maxsize=8)
def _names_rollout_mask_sums(roots: tuple[str, ...]) -> bool | None:
    for root in roots:
        try:
            source = (Path(root) / "backends" / "megatron_utils" / "data.py").read_text()
        except OSError:
            continue
        return "rollout_mask_sums" in source
    return None


def slime_rollout_reducer() -> bool | None:
    """Whether the slime in this process reduces the loss per rollout (v0.3.1 and later), read
    from its own source without importing it (that needs Megatron): its
    backends/megatron_utils/data.py names `rollout_mask_sums`. None when slime's source is not
    on disk to read (unknown: nothing is refused)."""
    module = sys.modules.get("slime")
    roots = getattr(module, "__path__", None)
    if roots is None:
        try:
            import importlib.util

            spec = importlib.util.find_spec("slime")
        except (ImportError, ValueError):
            return None
        roots = spec.submodule_search_locations if spec else None
    return _names_rollout_mask_sums(tuple(str(r) for r in roots or ()))


def refusal(args: Any, framework_name: str, *, dynamic_history: bool) -> str | None:
    """Why the run's flags cannot take the plugin's samples (None: they can)."""
    if _on(args, "group_rm"):
        return (
            "--group-rm is not supported: swerl's reward is the task's tests' verdict, set on "
            f"each sample by the plugin, and {framework_name}'s group reward model would "
            "overwrite it (or assert it unset); turn the flag off"
        )
    for name in ("reward_key", "eval_reward_key"):
        key = getattr(args, name, None)
        if key:
            return (
                f"--{name.replace('_', '-')} {key} is not supported: swerl's reward is one "
                f"float per sample (the tests' verdict), which {framework_name} would index by "
                "that key; leave it unset"
            )
    if framework_name == "miles" and _on(args, "use_rollout_indexer_replay"):
        return (
            "--use-rollout-indexer-replay is not supported: swerl's agent returns no indexer "
            "top-k (Sample.rollout_indexer_topk); turn the flag off"
        )
    if not dynamic_history:
        return None
    flag = "swerl_dynamic_history"
    if framework_name == "slime" and slime_rollout_reducer() is False:
        return (
            f"{flag} needs slime v0.3.1 or later: this slime reduces the loss per sample, not"
            " per rollout (its megatron_utils/data.py has no rollout_mask_sums), so each"
            " episode's list of per-turn samples would weigh as many episodes; upgrade slime or"
            " turn dynamic history off"
        )
    align = static_alignment(args)
    if align > 1:
        return (
            f"{flag} without --use-dynamic-batch-size at a data-parallel size x micro-batch group"
            f" of {align}: one sample per turn gives each train step a sample count that"
            f" {framework_name}'s static micro-batches cannot split into a multiple of {align}"
            " (its dp_schedule raises at the train step); add --use-dynamic-batch-size (with"
            " --max-tokens-per-gpu) or turn dynamic history off"
        )
    if _on(args, "partial_rollout"):
        return (
            f"--partial-rollout with {flag}: partial rollout reads .response of each group "
            "entry and one sample per turn is a list; turn one of them off"
        )
    if framework_name == "slime" and _on(args, "log_passrate"):
        return (
            f"--log-passrate with {flag}: slime's pass rate asserts one sample per episode; "
            "turn one of them off"
        )
    if framework_name == "miles" and _on(args, "recompute_logprobs_via_prefill"):
        return (
            f"--recompute-logprobs-via-prefill with {flag}: miles' prefill reads "
            "response_length of each group entry and one sample per turn is a list; turn one "
            "of them off"
        )
    gbs = _dynamic_gbs_flag(args) if framework_name == "miles" else None
    if gbs is not None:
        return (
            f"{gbs} with {flag}: one sample per turn is a list sharing rollout_id, which makes "
            "miles' batch compact and leaves it without the dynamic global batch size it "
            "asserts on; turn one of them off"
        )
    return None


def lists_allowed(args: Any, framework_name: str) -> bool:
    """Whether a whole-trajectory call may return its chains as a list of samples."""
    if _on(args, "partial_rollout") or static_alignment(args) > 1:
        return False
    if framework_name == "slime":
        if slime_rollout_reducer() is False:
            return False
        path = str(getattr(args, "rollout_function_path", "") or "")
        return not _on(args, "log_passrate") and "fully_async" not in path
    recompute = _on(args, "recompute_logprobs_via_prefill")
    return not recompute and _dynamic_gbs_flag(args) is None


def engine_context_length(args: Any) -> int | None:
    """The policy engine's context length as the run configures it: `--sglang-context-length`
    (the frameworks pass SGLang's server args with that prefix), else the checkpoint's
    `max_position_embeddings` (SGLang's default), else None (unknown)."""
    configured = getattr(args, "sglang_context_length", None)
    if configured:
        return int(configured)
    checkpoint = getattr(args, "hf_checkpoint", None)
    config = Path(str(checkpoint)) / "config.json" if checkpoint else None
    if config is None or not config.is_file():
        return None
    try:
        found = json.loads(config.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(found) if isinstance(found, int) and found > 0 else None


def auto_truncate_refusal(args: Any, budget: int, engine: int | None) -> str | None:
    """Why `--sglang-allow-auto-truncate` cannot run with this budget (None: it can): the engine
    would cut every prompt past its context length instead of refusing it, so the tokens it
    samples on would not be the ones the episode recorded. With a budget within the engine's
    context the episodes never send such a prompt."""
    if not _on(args, "sglang_allow_auto_truncate") or not budget:
        return None
    if engine is not None and budget <= engine:
        return None
    if engine:
        over, fix = f"over its context length ({engine} tokens)", "lower the budget to it"
    else:
        over = "and the engine's context length unknown"
        fix = "name it with --sglang-context-length"
    return (
        f"--sglang-allow-auto-truncate with an episode context budget of {budget} tokens (swerl"
        f" max_context_tokens or --rollout-max-context-len) {over}: SGLang would cut longer"
        " prompts silently and sample on a context the episode did not record; turn the flag"
        f" off (the engine's refusal ends an episode LIMIT_CONTEXT), or {fix}"
    )


def context_budget_note(budget: int, engine: int | None) -> str | None:
    """One line when the episodes' context budget is larger than the engine's context length:
    SGLang refuses a prompt past its length (HTTP 400), so episodes end LIMIT_CONTEXT there."""
    if not budget or engine is None or budget <= engine:
        return None
    return (
        f"the episodes' context budget ({budget} tokens: swerl max_context_tokens or "
        f"--rollout-max-context-len) is larger than the policy engine's context length "
        f"({engine} tokens): SGLang refuses longer prompts, so episodes end LIMIT_CONTEXT at "
        f"{engine}; lower the budget or raise --sglang-context-length"
    )
