"""Helpers of the PRM tests: a small judge tokenizer unlike the policy's, steps to judge, and
the running pieces (scripted judge model server, PRM service, client) wired together."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from swerl.chassis.client import error_info, make_channel
from swerl.devservers.scripted_prm import ScriptedJudge
from swerl.prm.client import PrmClient
from swerl.prm.prompt import CurrentStep, HistoryStep, StepToJudge
from swerl.prm.server import PrmServer
from swerl.prm.settings import PrmSettings
from swerl.prm.v1 import prm_pb2_grpc

TOKEN = "prm-test-token"
JUDGE_TEMPLATE_MARK = "<|verdict_turn|>"
ISSUE = "chunk() drops the last partial chunk when len(items) is not a multiple of size"


def build_judge_tokenizer(directory: Path) -> Path:
    """A byte-level tokenizer with its own special tokens and chat template, made offline.

    It stands for a judge model whose tokenizer and template differ from the policy's (Qwen3):
    every byte is one token, and the template marks turns with tokens Qwen3 does not have.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    model = models.BPE(vocab=vocab, merges=[])
    core = Tokenizer(model)
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|judge_bos|>",
        eos_token="<|judge_eos|>",
        additional_special_tokens=[JUDGE_TEMPLATE_MARK, "<|judge_msg|>"],
    )
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|judge_msg|>{{ m['role'] }}: {{ m['content'] }}"
        "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}"
        + JUDGE_TEMPLATE_MARK
        + "{% endif %}"
    )
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return directory


def make_step(
    action: str = "grep -n 'def chunk' listutils/core.py",
    *,
    episode_id: str = "ep-1",
    step_index: int = 0,
    issue: str = ISSUE,
    history: tuple[HistoryStep, ...] = (),
    response: str | None = None,
    exit_code: int = 0,
    output: str = "12:def chunk(items, size):",
) -> StepToJudge:
    return StepToJudge(
        episode_id=episode_id,
        step_index=step_index,
        issue=issue,
        history=history,
        step=CurrentStep(
            response=response if response is not None else f"Look.\n```bash\n{action}\n```",
            action=action,
            exit_code=exit_code,
            output=output,
        ),
    )


def prm_settings(judge_url: str, tokenizer_dir: Path | None, **overrides: Any) -> PrmSettings:
    values: dict[str, Any] = dict(
        host="127.0.0.1",
        port=0,
        auth_token=TOKEN,
        judge_url=judge_url,
        judge_tokenizer_path=tokenizer_dir,
        drain_grace_s=0.5,
        request_timeout_s=10.0,
        retry_max_delay_s=5.0,
        log_level="warning",
    )
    values.update(overrides)
    return PrmSettings(**values)


@dataclass
class RunningPrm:
    server: PrmServer
    channel: grpc.aio.Channel
    client: PrmClient
    stub: prm_pb2_grpc.PrmServiceStub

    @property
    def address(self) -> str:
        return self.server.address


async def start_prm(settings: PrmSettings) -> RunningPrm:
    server = PrmServer(settings)
    await server.start()
    channel = make_channel(server.address, token=TOKEN)
    return RunningPrm(
        server, channel, PrmClient(channel, timeout_s=30), prm_pb2_grpc.PrmServiceStub(channel)
    )


async def stop_prm(running: RunningPrm) -> None:
    await running.channel.close()
    await running.server.stop(0)


async def rpc_failure(call: Any) -> tuple[grpc.StatusCode, str | None]:
    """(code, ErrorInfo reason) of an awaitable call that must fail."""
    try:
        await call
    except grpc.aio.AioRpcError as err:
        return err.code(), error_info(err)[0]
    raise AssertionError("the call succeeded")


__all__ = ["ScriptedJudge"]
