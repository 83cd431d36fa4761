"""PRM benchmark: what the judge service adds on top of the judge model's own HTTP calls.

    python benchmarks/prm_bench.py [--judgments N] [--votes M] [--concurrency C]
                                   [--judge-delay-s S] [--json OUT]

Starts `swerl prm scripted-judge` (a scripted SGLang /generate server answering `\\boxed{+1}`
after --judge-delay-s, standing in for the model) and `swerl prm serve` over it with the real
Qwen3 tokenizer as the judge's tokenizer, both as separate processes. Then, in one run:
  (a) the baseline: N x M POSTs of /generate with pre-tokenized ids of a typical judge prompt,
      straight to the scripted judge, C judgments' worth (C x M requests) in flight at once;
  (b) N JudgeStep calls (M votes each) through the PRM service, C in flight at once (the
      service builds the prompt, tokenizes it with the judge tokenizer, samples M votes).
It prints votes per second of each, their ratio (service / baseline), and the JudgeStep latency
p50/p99 against the baseline's per-judgment time. It reports; it does not assert.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import docker
from benchkit import free_port, machine_facts, progress, run_main

from swerl.chassis.client import make_channel
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir, load_tokenizer
from swerl.prm.client import PrmClient
from swerl.prm.prompt import CurrentStep, HistoryStep, PromptLimits, StepToJudge, build_messages
from swerl.prm.votes import JudgeState

START_TIMEOUT_S = 90.0


def typical_step(episode: int, index: int) -> StepToJudge:
    """A mid-episode step: a 3 kB issue, 8 earlier steps with output, a 2 kB response."""
    history = tuple(
        HistoryStep(
            action=f"grep -rn 'def chunk' src/module_{i}.py",
            exit_code=i % 2,
            output_head="\n".join(f"src/module_{i}.py:{n}: def chunk(items):" for n in range(20)),
        )
        for i in range(8)
    )
    response = "Let me check how chunk handles the remainder. " * 40
    return StepToJudge(
        episode_id=f"bench-{episode}",
        step_index=index,
        issue="chunk() drops the last partial chunk. " * 80,
        history=history,
        step=CurrentStep(
            response=response + "\n```bash\npython -m pytest tests/test_chunk.py -q\n```",
            action="python -m pytest tests/test_chunk.py -q",
            exit_code=1,
            output="F.\n" + "E   AssertionError: [1, 2] != [1, 2, 3]\n" * 60,
        ),
    )


def start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "swerl.cli", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )


def wait_for_line(process: subprocess.Popen[bytes], log: Path, pattern: str) -> re.Match[str]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        match = re.search(pattern, log.read_text(errors="replace"))
        if match:
            return match
        if process.poll() is not None:
            raise RuntimeError(f"{process.args} exited:\n{log.read_text(errors='replace')}")
        time.sleep(0.1)
    raise TimeoutError(f"no {pattern!r} in {log} after {START_TIMEOUT_S} s")


def stopper(process: subprocess.Popen[bytes]) -> Callable[[], None]:
    def stop() -> None:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    return stop


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def baseline(url: str, ids: list[int], args: argparse.Namespace) -> dict[str, float]:
    """N x M /generate POSTs with ready ids, C x M in flight: the model calls alone."""
    slots = asyncio.Semaphore(args.concurrency)
    times: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def vote(seed: int) -> None:
            body = {"input_ids": ids, "sampling_params": {"sampling_seed": seed}}
            async with session.post(url + "/generate", json=body) as response:
                await response.read()

        async def judgment(n: int) -> None:
            async with slots:
                started = time.perf_counter()
                await asyncio.gather(*(vote(n * args.votes + i) for i in range(args.votes)))
                times.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(judgment(n) for n in range(args.judgments)))
        elapsed = time.perf_counter() - started
    return summary(times, elapsed, args)


async def through_service(address: str, token: str, args: argparse.Namespace) -> dict[str, float]:
    slots = asyncio.Semaphore(args.concurrency)
    times: list[float] = []
    failed = 0
    channel = make_channel(address, token=token)
    client = PrmClient(channel, timeout_s=120)

    async def judgment(n: int) -> None:
        nonlocal failed
        async with slots:
            started = time.perf_counter()
            verdict = await client.judge_step(typical_step(n % 64, n // 64), votes=args.votes)
            times.append(time.perf_counter() - started)
            failed += verdict.state is not JudgeState.SCORED

    try:
        started = time.perf_counter()
        await asyncio.gather(*(judgment(n) for n in range(args.judgments)))
        elapsed = time.perf_counter() - started
    finally:
        await channel.close()
    return {**summary(times, elapsed, args), "not_scored": failed}


def summary(times: list[float], elapsed: float, args: argparse.Namespace) -> dict[str, float]:
    return {
        "elapsed_s": round(elapsed, 3),
        "votes_per_s": round(args.judgments * args.votes / elapsed, 1),
        "judgment_p50_ms": round(statistics.median(times) * 1000, 2),
        "judgment_p99_ms": round(percentile(times, 0.99) * 1000, 2),
    }


def run(args: argparse.Namespace, workdir: Path, cleanup: list[Callable[[], None]]) -> dict:
    client = docker.from_env()
    facts = machine_facts(client, hardware=True)
    client.close()
    progress(f"machine: {facts}")
    tokenizer_dir = bundled_qwen3_tokenizer_dir()

    judge_port = free_port()
    judge_log = workdir / "judge.log"
    judge = start(
        [
            "prm",
            "scripted-judge",
            "--port",
            str(judge_port),
            "--delay-s",
            str(args.judge_delay_s),
            "--reply",
            "The test run shows the failure.\\n\\boxed{+1}",
        ],
        judge_log,
        {},
    )
    cleanup.append(stopper(judge))
    wait_for_line(judge, judge_log, r"serving /generate")
    judge_url = f"http://127.0.0.1:{judge_port}"
    progress(f"scripted judge on {judge_url} (answers after {args.judge_delay_s} s)")

    token = secrets.token_urlsafe(16)
    prm_log = workdir / "prm.log"
    prm = start(
        ["prm", "serve", "--host", "127.0.0.1", "--port", "0", "--log-level", "warning"],
        prm_log,
        {
            "SWERL_PRM_AUTH_TOKEN": token,
            "SWERL_PRM_JUDGE_URL": judge_url,
            "SWERL_PRM_JUDGE_TOKENIZER_PATH": str(tokenizer_dir),
            "SWERL_PRM_MAX_CONCURRENT_REQUESTS": str(args.concurrency * args.votes),
        },
    )
    cleanup.append(stopper(prm))
    port = wait_for_line(prm, prm_log, r"serving on 127\.0\.0\.1:(\d+)").group(1)
    address = f"127.0.0.1:{port}"
    progress(f"swerl prm serve on {address}")

    messages = build_messages(typical_step(0, 8), PromptLimits())
    tokenizer = load_tokenizer(tokenizer_dir)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    progress(f"typical judge prompt: {len(text)} chars, {len(ids)} Qwen3 tokens")

    asyncio.run(
        through_service(address, token, argparse.Namespace(**{**vars(args), "judgments": 20}))
    )
    progress(f"baseline: {args.judgments} x {args.votes} /generate, {args.concurrency} at once")
    base = asyncio.run(baseline(judge_url, ids, args))
    progress(f"  {base}")
    progress(f"service: {args.judgments} JudgeStep (m={args.votes}), {args.concurrency} at once")
    served = asyncio.run(through_service(address, token, args))
    progress(f"  {served}")

    ratio = served["votes_per_s"] / base["votes_per_s"]
    overhead_ms = served["judgment_p50_ms"] - base["judgment_p50_ms"]
    print()
    print(f"prompt tokens (Qwen3 judge tokenizer): {len(ids)}")
    print(f"baseline votes/s (direct /generate):   {base['votes_per_s']}")
    print(f"service votes/s (JudgeStep):           {served['votes_per_s']}")
    print(f"throughput ratio service/baseline:     {ratio:.3f}")
    print(
        f"judgment p50 ms: service {served['judgment_p50_ms']} vs baseline"
        f" {base['judgment_p50_ms']} (+{overhead_ms:.2f} ms); p99 service"
        f" {served['judgment_p99_ms']} vs baseline {base['judgment_p99_ms']}"
    )
    print(f"judgments not SCORED: {served['not_scored']}")
    report: dict[str, Any] = {
        "machine": facts,
        "settings": vars(args) | {"json": None},
        "prompt_tokens": len(ids),
        "baseline": base,
        "service": served,
        "throughput_ratio": round(ratio, 3),
        "p50_overhead_ms": round(overhead_ms, 2),
    }
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--judgments", type=int, default=300, help="judgments per phase")
    parser.add_argument("--votes", type=int, default=3, help="votes per judgment (m)")
    parser.add_argument("--concurrency", type=int, default=32, help="judgments in flight")
    parser.add_argument(
        "--judge-delay-s", type=float, default=0.05, help="scripted model latency per vote"
    )
    parser.add_argument("--json", type=Path, help="write the report here")
    return run_main(parser.parse_args(), run, "swerl-prm-bench-")


if __name__ == "__main__":
    sys.exit(main())
