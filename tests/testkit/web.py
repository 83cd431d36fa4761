"""Helpers of the browser tests: start messages for real episodes, console errors of a page, and
a `swerl` web command run as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from selenium import webdriver

from swerl.agent.v1 import agent_pb2 as pb
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir
from swerl.chassis.timeconv import duration_pb
from swerl.tasks import TaskInstance
from swerl.validate import instance_to_pb

TOKENIZER_DIR = str(bundled_qwen3_tokenizer_dir())


def start_message(
    task: TaskInstance, url: str, episode_id: str, artifact_dir: str, *, dynamic: bool = False
) -> pb.EpisodeStart:
    start = pb.EpisodeStart(
        episode_id=episode_id,
        instance=instance_to_pb(task.instance),
        policy=pb.PolicyConfig(
            endpoint=url,
            api=pb.POLICY_API_SGLANG_GENERATE,
            model="replay",
            tokenizer_path=TOKENIZER_DIR,
        ),
        limits=pb.EpisodeLimits(
            max_turns=8,
            max_new_tokens=2048,
            command_timeout=duration_pb(60),
            eval_timeout=duration_pb(300),
        ),
        options=pb.EpisodeOptions(
            dynamic_history=dynamic, artifact_dir=artifact_dir, owner="web-test"
        ),
    )
    start.policy.sampling_params.update({"temperature": 1.0, "top_p": 1.0})
    return start


async def run_episode(stub, start: pb.EpisodeStart) -> pb.EpisodeResult:
    result = None
    async for message in stub.RunEpisode(iter([pb.RunEpisodeRequest(start=start)]), timeout=900):
        if message.WhichOneof("kind") == "result":
            result = message.result
    assert result is not None
    return result


def console_errors(driver: webdriver.Chrome) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


class Served:
    """`swerl inspect` (or dashboard) as a user runs it: a subprocess, its URL read from stdout."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swerl.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.url = ""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            match = re.search(r"(http://\S+/)", line)
            if match:
                self.url = match.group(1).rstrip("/")
                break
        assert self.url, "".join(self.lines)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def save_screenshot(driver: webdriver.Chrome, path: Path) -> Path:
    """Saves the page as PNG at `path`; a screenshot chromium did not write fails the test
    (selenium's save_screenshot only returns False), so a run's pictures are never silently
    missing."""
    assert driver.save_screenshot(str(path)), f"chromium did not save the screenshot {path}"
    assert path.stat().st_size > 0, path
    return path
