"""`swerl prm serve` as a process, and the settings it is built from."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys

import pytest
from pydantic import ValidationError
from testkit.prm import make_step

from swerl.chassis.client import make_channel
from swerl.devservers.scripted_prm import verdict
from swerl.prm.client import PrmClient
from swerl.prm.settings import PrmSettings
from swerl.prm.votes import JudgeState


async def test_swerl_prm_serve_judges_through_its_judge_and_exits_0_on_sigterm(
    scripted, judge_tokenizer_dir
):
    judge = await scripted(default=[verdict(-1)])
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "swerl.cli",
        "prm",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--insecure",
        "--judge-url",
        judge.url,
        "--judge-tokenizer-path",
        str(judge_tokenizer_dir),
        "--default-votes",
        "2",
        "--log-level",
        "warning",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "SWERL_PRM_MAX_CONCURRENT_REQUESTS": "4"},
    )
    try:
        banner = ""
        while "serving on" not in banner:
            line = await asyncio.wait_for(process.stdout.readline(), 60)
            assert line, "swerl prm serve exited before serving"
            banner = line.decode()
        port = int(re.search(r":(\d+) ", banner).group(1))
        channel = make_channel(f"127.0.0.1:{port}")
        try:
            result = await PrmClient(channel).judge_step(make_step(), timeout_s=30)
        finally:
            await channel.close()

        assert result.state is JudgeState.SCORED
        assert result.score == -1.0
        assert len(result.votes) == 2
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(process.wait(), 30)
    assert code == 0


def test_the_sglang_backend_needs_the_judges_own_tokenizer():
    with pytest.raises(ValidationError, match="judge_tokenizer_path is required"):
        PrmSettings(insecure=True)


def test_the_openai_backend_needs_a_model_name():
    with pytest.raises(ValidationError, match="judge_model is required"):
        PrmSettings(insecure=True, backend="openai")


def test_the_default_vote_count_cannot_exceed_the_maximum(tmp_path):
    with pytest.raises(ValidationError, match="default_votes"):
        PrmSettings(insecure=True, judge_tokenizer_path=tmp_path, default_votes=5, max_votes=4)


def test_settings_come_from_swerl_prm_env_vars(monkeypatch, tmp_path):
    monkeypatch.setenv("SWERL_PRM_JUDGE_TOKENIZER_PATH", str(tmp_path))
    monkeypatch.setenv("SWERL_PRM_MAX_CONCURRENT_REQUESTS", "7")
    monkeypatch.setenv("SWERL_PRM_CHAT_TEMPLATE_KWARGS", '{"enable_thinking": false}')

    settings = PrmSettings(insecure=True)

    assert settings.port == 18092
    assert settings.max_concurrent_requests == 7
    assert settings.chat_template_kwargs == {"enable_thinking": False}


async def test_swerl_prm_scripted_judge_answers_generate_with_its_replies_in_order(
    judge_tokenizer_dir, unused_tcp_port
):
    import aiohttp

    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "swerl.cli",
        "prm",
        "scripted-judge",
        "--port",
        str(unused_tcp_port),
        "--tokenizer-path",
        str(judge_tokenizer_dir),
        "--reply",
        "first\\n\\boxed{-1}",
        "then \\boxed{+1}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        line = b""
        while b"serving /generate" not in line:
            line = await asyncio.wait_for(process.stdout.readline(), 60)
            assert line, "swerl prm scripted-judge exited before serving"
        url = f"http://127.0.0.1:{unused_tcp_port}/generate"
        texts = []
        async with aiohttp.ClientSession() as session:
            for seed in range(3):
                body = {"input_ids": [72, 105], "sampling_params": {"sampling_seed": seed}}
                async with session.post(url, json=body) as response:
                    texts.append((await response.json())["text"])
    finally:
        await _stop_by_signal(process, signal.SIGINT)

    assert texts == ["first\n\\boxed{-1}", "then \\boxed{+1}", "then \\boxed{+1}"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
async def test_swerl_prm_scripted_judge_stops_on_a_signal_even_when_started_with_it_ignored(
    judge_tokenizer_dir, unused_tcp_port, signum
):
    # A background job of a non-interactive shell (a test runner's, a script's) starts with
    # SIGINT ignored; Python then installs no KeyboardInterrupt handler for it.
    process = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        f"trap '' {signum.name.removeprefix('SIG')}; exec \"$@\"",
        "judge",
        sys.executable,
        "-m",
        "swerl.cli",
        "prm",
        "scripted-judge",
        "--port",
        str(unused_tcp_port),
        "--tokenizer-path",
        str(judge_tokenizer_dir),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        line = b""
        while b"serving /generate" not in line:
            line = await asyncio.wait_for(process.stdout.readline(), 60)
            assert line, "swerl prm scripted-judge exited before serving"
    finally:
        returncode = await _stop_by_signal(process, signum)
    assert returncode == 0


async def _stop_by_signal(process: asyncio.subprocess.Process, signum: signal.Signals) -> int:
    """Sends `signum`; the process must exit within 30 s (else it is killed, and that fails)."""
    process.send_signal(signum)
    try:
        return await asyncio.wait_for(process.wait(), 30)
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"did not exit within 30 s of {signum.name}") from None
