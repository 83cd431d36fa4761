"""Metrics the trainers compute from our samples are real (issue 23 item 8): the engine's
prefix-cache counts (TokenRecord.cached_tokens / engine_prompt_tokens, from SGLang's
`meta_info.cached_tokens` / `prompt_tokens`) become Sample.prefix_cache_info, which both
frameworks sum into `rollout/prefix_cache_hit_rate` (slime observability/rollout_metrics.py:202-210,
miles ray/rollout/metrics.py:209-216); a branch's sampling_seed is marked effective only when the
engine honours seeds (`--sglang-enable-deterministic-inference`).

Runs against the stand-in SWERL_TEST_FRAMEWORK names (conftest.py); CI runs both.
"""

from __future__ import annotations

import asyncio

import pytest
import structlog
from testkit import standin_common
from testkit.playback import PlaybackAgent, PlaybackServer, Scenario, branch_result, result
from testkit.plugin import make_args, make_sample

from swerl.trainer_plugin import refusals

pytestmark = pytest.mark.usefixtures("fw")


def cached(counts_per_record):
    """An agent whose records carry the engine's (cached, prompt) counts, in record order."""

    def answer(start):
        out = result(start, n_turns=3)
        records = out.turns if start.options.dynamic_history else [out.trajectory]
        for record, (hit, total) in zip(records, counts_per_record, strict=False):
            record.cached_tokens, record.engine_prompt_tokens = hit, total
        return Scenario(result=out)

    return answer


@pytest.mark.parametrize("dynamic_history", [False, True])
async def test_prefix_cache_hit_rate_is_the_engines_cached_share(
    fw, sampling_params, dynamic_history
):
    counts = [(0, 100), (90, 130), (120, 170)]
    async with PlaybackServer(PlaybackAgent(cached(counts))) as server:
        args = make_args([server.address], dynamic_history=dynamic_history)
        outs = await asyncio.gather(
            *(fw.generate(args, make_sample(index=i), sampling_params) for i in range(2))
        )
    samples = standin_common.flat_samples(list(outs))
    standin_common.LOGGED.clear()
    fw.log_rollout(args, 0, samples, None)
    (logged,) = [m for _, m in standin_common.LOGGED if "rollout/prefix_cache_hit_rate" in m]
    if dynamic_history:
        want_hit, want_total = sum(h for h, _ in counts), sum(t for _, t in counts)
    else:
        want_hit, want_total = counts[0]
    assert logged["rollout/prefix_cache_hit_rate"] == pytest.approx(want_hit / want_total)
    assert [s.prefix_cache_info.cached_tokens for s in samples[: len(samples) // 2]] == (
        [h for h, _ in counts] if dynamic_history else [counts[0][0]]
    )


@pytest.mark.parametrize("deterministic", [False, True])
async def test_a_branch_seed_is_effective_only_under_deterministic_inference(
    fw, sampling_params, deterministic
):
    def answer(start):
        return Scenario(
            results=[branch_result(start, b, reward=1.0) for b in range(start.options.branch.count)]
        )

    async with PlaybackServer(PlaybackAgent(answer)) as server:
        args = make_args([server.address], branch_at_turn=1)
        args.n_samples_per_prompt = 2
        args.sglang_enable_deterministic_inference = deterministic
        outs = await asyncio.gather(
            *(fw.generate(args, make_sample(index=i), sampling_params) for i in range(2))
        )
    for out in outs:
        sample = out[0] if isinstance(out, list) else out
        assert sample.metadata["sampling_seed"] > 0
        assert sample.metadata["sampling_seed_effective"] is deterministic


@pytest.mark.parametrize(("engine", "warned"), [(8192, True), (32768, False)])
async def test_a_context_budget_over_the_engines_context_length_is_said_once_per_run(
    fw, sampling_params, engine, warned
):
    async with PlaybackServer(PlaybackAgent(lambda start: Scenario())) as server:
        args = make_args([server.address])  # --rollout-max-context-len 16384
        args.sglang_context_length = engine
        with structlog.testing.capture_logs() as logs:
            for i in range(2):
                await fw.generate(args, make_sample(index=i), sampling_params)
    notes = [e for e in logs if e["event"] == "context_budget.over_engine"]
    if warned:
        (note,) = notes  # once per run, not once per call
        assert "16384" in note["detail"] and "8192" in note["detail"]
    else:
        assert notes == []


def test_the_engines_context_length_falls_back_to_the_checkpoints_config(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 40960}')
    args = make_args(["x:1"])
    args.hf_checkpoint = str(tmp_path)
    assert refusals.engine_context_length(args) == 40960
    args.sglang_context_length = 4096
    assert refusals.engine_context_length(args) == 4096
