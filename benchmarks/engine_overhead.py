"""agent_bench's `--engine vllm` measurement: swerl's costs around a real vLLM engine, beside the
replay, in one run.

1. Per-turn bookkeeping: the same scripted episodes (agent_bench's bench script, in-memory
   sandboxes, one at a time) through the agent's runner, their policy the replay server
   (SGLang's /generate) or the vLLM engine (VLLM_GENERATE) forced to the same turns
   (swerl.devservers.forcing). Figure: the episode's `overhead_time` (its wall time less model,
   commands and grading) per turn, and the model's time per turn.
2. Policy client overhead: one prompt sent N times through swerl's policy client
   (`VllmPolicy.generate`: body built, posted with retries, reply read and checked) and N times
   as the same /inference/v1/generate body posted straight with aiohttp and read with
   json.loads, interleaved; the same for SglangPolicy and the replay. Figure: p50 of each and the
   client's p50 over the direct call's.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp

from swerl.chassis.hf import bundled_qwen3_tokenizer_dir, load_tokenizer

# The engine's own figures depend on these (benchkit.software_line).
ENGINE_DISTRIBUTIONS = ("aiohttp", "transformers", "tokenizers", "grpcio")
SCRIPT_KEY = "Benchmark issue"


async def scripted_episodes(
    policy_url: str,
    api: int,
    episodes: int,
    turns: int,
    provider: Any,
    model: str = "",
) -> dict[str, float]:
    """`episodes` scripted episodes one after another; per-turn overhead and model time."""
    from swerl.agent.client import episode_limits, episode_start
    from swerl.agent.loop.runner import EpisodeRunner
    from swerl.agent.settings import AgentSettings
    from swerl.agent.v1 import agent_pb2 as pb
    from swerl.exec.v1 import evaluate_pb2

    settings = AgentSettings(insecure=True, port=0, log_level="warning")
    runner = EpisodeRunner(settings, provider)
    tokenizer = str(bundled_qwen3_tokenizer_dir())
    await runner.codec(tokenizer, {})

    async def one(index: int) -> pb.EpisodeResult:
        start = episode_start(
            episode_id=f"engine-bench-{index}",
            instance=evaluate_pb2.SweInstance(
                instance_id=f"bench__{index}",
                image_name="memory",
                problem_statement=f"{SCRIPT_KEY} {index}: handler drops bodies.",
                fail_to_pass=["t"],
            ),
            policy=pb.PolicyConfig(
                endpoint=policy_url, api=api, model=model, tokenizer_path=tokenizer
            ),
            limits=episode_limits(max_turns=turns + 2, max_new_tokens=1024),
            sampling_params={"temperature": 1.0},
        )

        async def requests():  # type: ignore[no-untyped-def]
            yield pb.RunEpisodeRequest(start=start)

        result = None
        async for message in runner.stream(requests()):
            if message.WhichOneof("kind") == "result":
                result = message.result
        assert result is not None
        return result

    try:
        await one(-1)  # warm: first-call costs (the HTTP session, imports) stay out
        results = [await one(i) for i in range(episodes)]
    finally:
        await runner.close()
    done = [r for r in results if r.status == pb.EPISODE_STATUS_SUBMITTED]
    turns_done = sum(int(r.metrics["turns"]) for r in results)
    overhead = [r.metrics["overhead_time"] / r.metrics["turns"] for r in results]
    model = [r.metrics["model_query_time_sum"] / r.metrics["turns"] for r in results]
    return {
        "episodes": len(results),
        "submitted": len(done),
        "turns": turns_done,
        "overhead_ms_per_turn_median": statistics.median(overhead) * 1e3,
        "model_ms_per_turn_median": statistics.median(model) * 1e3,
    }


def _prompt_ids(tokens: int) -> list[int]:
    tokenizer = load_tokenizer(bundled_qwen3_tokenizer_dir())
    text = "The handler drops request bodies when the client sends a chunked upload. " * 200
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [int(t) for t in ids[:tokens]]


async def client_overhead(
    make_policy: Callable[[aiohttp.ClientSession], Any],
    direct_body: Callable[[list[int], int], dict[str, Any]],
    url: str,
    calls: int,
    prompt_tokens: int,
    max_new_tokens: int,
) -> dict[str, float]:
    """swerl's client and a direct aiohttp call on the same request, interleaved."""
    prompt = _prompt_ids(prompt_tokens)
    ours: list[float] = []
    direct: list[float] = []
    async with aiohttp.ClientSession() as session:
        policy = make_policy(session)
        headers = {"Content-Type": "application/json"}

        async def straight() -> None:
            body = json.dumps(direct_body(prompt, max_new_tokens), separators=(",", ":"))
            async with session.post(url, data=body.encode(), headers=headers) as answer:
                raw = await answer.read()
                assert answer.status == 200, raw[:200]
            json.loads(raw)

        for _ in range(3):  # warm both paths (connections, the engine's prefix cache)
            await policy.generate(prompt, max_new_tokens)
            await straight()
        for i in range(calls):
            for first in (i % 2 == 0, i % 2 == 1):
                began = time.perf_counter()
                if first:
                    await policy.generate(prompt, max_new_tokens)
                    ours.append(time.perf_counter() - began)
                else:
                    await straight()
                    direct.append(time.perf_counter() - began)
    ours_p50, direct_p50 = statistics.median(ours), statistics.median(direct)
    return {
        "calls_each": calls,
        "client_p50_ms": ours_p50 * 1e3,
        "direct_p50_ms": direct_p50 * 1e3,
        "client_overhead_p50_ms": (ours_p50 - direct_p50) * 1e3,
        "client_over_direct": ours_p50 / direct_p50,
    }


def vllm_direct_body(
    params: dict[str, Any], model: str
) -> Callable[[list[int], int], dict[str, Any]]:
    """The body VllmPolicy sends (services/agent/policy/vllm.py `_body`), built by hand."""

    def body(prompt: list[int], max_new: int) -> dict[str, Any]:
        request: dict[str, Any] = {
            "request_id": f"direct-{uuid.uuid4().hex[:16]}",
            "token_ids": prompt,
            "sampling_params": {**params, "max_tokens": max_new, "logprobs": 0},
        }
        if model:
            request["model"] = model
        return request

    return body


def sglang_direct_body(params: dict[str, Any]) -> Callable[[list[int], int], dict[str, Any]]:
    """The body SglangPolicy sends to /generate, built by hand."""

    def body(prompt: list[int], max_new: int) -> dict[str, Any]:
        return {
            "input_ids": prompt,
            "sampling_params": {**params, "max_new_tokens": max_new},
            "return_logprob": True,
        }

    return body
