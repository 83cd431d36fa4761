"""`swerl eval --policy-api vllm --script gold`: the real vLLM engine, each turn forced to the gold
script's (swerl.devservers.forcing), resolves bundled tasks; a recording proxy between swerl
eval and the engine shows every sampled id in the records is the engine's own."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from testkit.vllm_engine import RecordingProxy, VllmEngine, wait_for_engine

from swerl.chassis.hf import bundled_qwen3_tokenizer_dir, load_tokenizer
from swerl.devservers.replay import scripts_for_tasks
from swerl.tasks import default_tasks_dir, load_tasks

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("base_image")]

TASKS = default_tasks_dir()
END_OF_TURN = 151645  # <|im_end|>: the tiny Qwen3's end of sequence


@pytest.fixture(scope="module")
def vllm_engine() -> VllmEngine:
    return wait_for_engine()


async def _eval(proxy_url: str, out: Path, instance: str, *extra: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "swerl.cli",
        "eval",
        str(TASKS),
        "--policy-api",
        "vllm",
        "--policy-url",
        proxy_url,
        "--script",
        "gold",
        "-j",
        "1",
        "-o",
        str(out),
        "--instance-ids",
        instance,
        *extra,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=dict(os.environ),
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=300)
    return process.returncode or 0, output.decode(errors="replace")


def _sampled_runs(tokens: dict) -> list[tuple[list[int], list[float]]]:
    """The record's mask-1 runs (one per sampled turn): ids and logprobs."""
    runs: list[tuple[list[int], list[float]]] = []
    record = tokens["trajectory"]
    previous = 0
    for token, mask, logprob in zip(
        record["response_ids"], record["loss_mask"], record["logprobs"], strict=True
    ):
        if mask and not previous:
            runs.append(([], []))
        if mask:
            runs[-1][0].append(token)
            runs[-1][1].append(logprob)
        previous = mask
    return runs


async def _forced_run(engine: VllmEngine, tmp_path: Path, instance: str, *extra: str):
    proxy = RecordingProxy(engine.url)
    await proxy.start()
    try:
        code, output = await _eval(proxy.url, tmp_path / "run", instance, *extra)
    finally:
        await proxy.stop()
    assert code == 0, output
    [record] = [
        json.loads(x) for x in (tmp_path / "run" / "results.jsonl").read_text().split("\n") if x
    ]
    tokens = json.loads((Path(record["artifact_dir"]) / "tokens.json").read_text())
    return record, tokens, proxy


def _gold_turns(instance: str) -> list[str]:
    [task] = [t for t in load_tasks(TASKS) if t.instance_id == instance]
    [script] = scripts_for_tasks([task], "gold").values()
    return script


def _assert_runs_are_the_engines(tokens: dict, proxy: RecordingProxy) -> list[list[int]]:
    generates = proxy.generates()
    assert generates and all(e.status == 200 for e in generates)
    engine = [e.response_json()["choices"][0] for e in generates]
    runs = _sampled_runs(tokens)
    assert [ids for ids, _ in runs] == [c["token_ids"] for c in engine]
    for (_, logprobs), choice in zip(runs, engine, strict=True):
        # tokens.json keeps the proto's float32 logprobs to 5 decimals.
        expected = [c["logprob"] for c in choice["logprobs"]["content"]]
        assert logprobs == pytest.approx(expected, abs=2e-5)
    return [ids for ids, _ in runs]


async def test_the_engine_forced_to_the_gold_tokens_resolves_the_task_and_samples_them(
    vllm_engine: VllmEngine, tmp_path: Path
) -> None:
    instance = "swerl-examples__romans-5"
    record, tokens, proxy = await _forced_run(
        vllm_engine, tmp_path, instance, "--forcing", "tokens"
    )
    assert record["status"] == "SUBMITTED" and record["resolved"], record
    sampled = _assert_runs_are_the_engines(tokens, proxy)
    # One allowed id at each step: vLLM masks the logits before its logprobs, so each is 0.
    assert all(
        lp == 0.0
        for lp, mask in zip(
            tokens["trajectory"]["logprobs"], tokens["trajectory"]["loss_mask"], strict=True
        )
        if mask
    )
    # The engine was sent each turn's token grammar and sampled exactly those ids.
    tokenizer = load_tokenizer(bundled_qwen3_tokenizer_dir())
    gold = _gold_turns(instance)
    assert len(sampled) == len(gold)
    for ids, turn, exchange in zip(sampled, gold, proxy.generates(), strict=True):
        canonical = tokenizer.encode(turn, add_special_tokens=False)
        assert ids == [*canonical, END_OF_TURN]
        grammar = exchange.request_json()["sampling_params"]["structured_outputs"]["grammar"]
        assert grammar == "start: " + " ".join(f"<[{t}]>" for t in canonical)


async def test_the_engine_forced_to_the_gold_text_resolves_with_its_own_token_split(
    vllm_engine: VllmEngine, tmp_path: Path
) -> None:
    instance = "swerl-examples__listutils-14"
    record, tokens, proxy = await _forced_run(vllm_engine, tmp_path, instance)  # text: default
    assert record["status"] == "SUBMITTED" and record["resolved"], record
    sampled = _assert_runs_are_the_engines(tokens, proxy)
    tokenizer = load_tokenizer(bundled_qwen3_tokenizer_dir())
    gold = _gold_turns(instance)
    assert len(sampled) == len(gold)
    for ids, turn, exchange in zip(sampled, gold, proxy.generates(), strict=True):
        assert exchange.request_json()["sampling_params"]["structured_outputs"] == {
            "choice": [turn]
        }
        assert ids[-1] == END_OF_TURN
        assert tokenizer.decode(ids[:-1], skip_special_tokens=False) == turn
    # The random model splits the text into more, shorter tokens than the tokenizer does; the
    # record keeps the engine's split (asserted equal to its reply above).
    canonical = tokenizer.encode(gold[0], add_special_tokens=False)
    assert len(sampled[0]) - 1 > len(canonical)
