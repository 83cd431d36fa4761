"""Token bookkeeping: the exact token stream of an episode, built incrementally.

The prompt is rendered once with the tokenizer's chat template. After that nothing is ever
re-rendered or re-tokenized: each turn appends the policy's own sampled ids (loss mask 1, with the
logprobs the server returned) and then the *template delta* of the observation (loss mask 0,
logprob 0.0): the tokens the chat template puts between the end of an assistant message and the
start of the next assistant message, i.e. the end-of-turn marker, the observation as a user
message, and the next assistant header. The delta depends only on the observation text, so a
turn costs O(its own tokens), whatever the history length.

The delta is measured once per template on a tiny fixed conversation with a sentinel assistant
message (`ChatCodec`), so it works for any HF chat template whose messages are concatenated; the
construction checks that and refuses templates that do not fit.

Units: the stream is `prompt + unit_0 + unit_1 + ...` where a unit is what one turn added after
the assistant header the policy continued from: `response ids + delta ids`. The delta ends with
the next assistant header, so the prompt of turn k is `prompt + units[:k]` unless the context
manager trimmed it (see context.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_SENTINEL = "SWERL_SENTINEL_ASSISTANT_MESSAGE_7f3a"


class TemplateMismatch(ValueError):
    """The chat template does not concatenate messages the way incremental bookkeeping needs."""


class ChatCodec:
    """Chat-template pieces of one tokenizer, measured once; everything else is appended ids.

    Thread-safe to use from a thread pool (the tokenizer is only read).
    """

    def __init__(
        self, tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None, path: str = ""
    ) -> None:
        self.tokenizer = tokenizer
        self.path = path  # where the tokenizer came from (worker processes load it again)
        self.template_kwargs = dict(template_kwargs or {})
        base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        without = self._render(base, generation_prompt=False)
        with_prompt = self._render(base, generation_prompt=True)
        if not with_prompt.startswith(without):
            raise TemplateMismatch("the generation prompt is not appended to the conversation")
        self.header_text = with_prompt[len(without) :]
        closed = self._render(
            [*base, {"role": "assistant", "content": _SENTINEL}], generation_prompt=False
        )
        if _SENTINEL not in closed:
            raise TemplateMismatch("the template drops assistant content")
        self.close_text = closed.split(_SENTINEL, 1)[1]
        self.header_ids = self.encode(self.header_text)
        self.close_ids = self.encode(self.close_text)
        if not self.header_ids or not self.close_ids:
            raise TemplateMismatch("empty assistant header or end-of-turn")
        # The end-of-turn token the policy emits itself when it stops (Qwen: <|im_end|>).
        self.end_of_turn_id = self.close_ids[0]
        self.vocab_size = len(tokenizer)

    def _render(self, messages: Sequence[Mapping[str, str]], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_prompt(self, system: str, user: str) -> list[int]:
        """The first prompt: system and instance messages plus the assistant header."""
        text = self._render(
            [{"role": "system", "content": system}, {"role": "user", "content": user}],
            generation_prompt=True,
        )
        ids = self.encode(text)
        if ids[-len(self.header_ids) :] != self.header_ids:
            raise TemplateMismatch("the first prompt does not end with the assistant header")
        return ids

    def user_message_text(self, text: str) -> str:
        """The text of one user message as the template writes it between two turns."""
        full = self._render(
            [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "U"},
                {"role": "assistant", "content": _SENTINEL},
                {"role": "user", "content": text},
            ],
            generation_prompt=True,
        )
        after = full.split(_SENTINEL, 1)[1]
        if not after.startswith(self.close_text) or not after.endswith(self.header_text):
            raise TemplateMismatch("a user message after an assistant message is not a pure delta")
        return after[len(self.close_text) : len(after) - len(self.header_text)]

    def observation_delta(self, response_ids: Sequence[int], observation: str) -> list[int]:
        """Tokens after the policy's response: end-of-turn (unless the policy emitted it), the
        observation as a user message, and the next assistant header."""
        text = self.user_message_text(observation)
        ids = self.encode(self.close_text + text + self.header_text)
        if response_ids and response_ids[-1] == self.end_of_turn_id:
            ids = ids[1:]
        return ids

    def user_message_ids(self, text: str) -> list[int]:
        """A standalone user message (the context manager's omission marker), no header."""
        return self.encode(self.user_message_text(text))


@dataclass
class TokenRecordData:
    """One training record (mirrors agent.v1.TokenRecord)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)

    def check(self) -> None:
        """Slime's Sample invariants; raises AssertionError naming the broken one."""
        n = len(self.response_ids)
        if not self.prompt_ids:
            raise AssertionError("empty prompt")
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise AssertionError(
                f"lengths differ: response {n}, loss_mask {len(self.loss_mask)},"
                f" logprobs {len(self.logprobs)}"
            )
        for mask, logprob in zip(self.loss_mask, self.logprobs, strict=True):
            if mask not in (0, 1) or (mask == 0 and logprob != 0.0):
                raise AssertionError("a masked token carries a logprob")


@dataclass
class Unit:
    """What one turn appended: the policy's ids (mask 1) and the template delta (mask 0)."""

    response_ids: list[int]
    logprobs: list[float]
    delta_ids: list[int]

    def __len__(self) -> int:
        return len(self.response_ids) + len(self.delta_ids)


class Trajectory:
    """The whole episode's token stream: the first prompt and one unit per turn.

    Appending is O(new tokens); `whole_record` builds the whole-episode record once at the end.
    """

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = prompt_ids
        self.units: list[Unit] = []
        self.turn_records: list[TokenRecordData] = []

    def add_turn(
        self,
        sent_prompt_ids: list[int],
        response_ids: list[int],
        logprobs: list[float],
        weight_version: str,
    ) -> None:
        """Records the exact prompt sent this turn and the response (dynamic history)."""
        if len(response_ids) != len(logprobs):
            raise ValueError("one logprob per response token")
        self.turn_records.append(
            TokenRecordData(
                prompt_ids=sent_prompt_ids,
                response_ids=list(response_ids),
                loss_mask=[1] * len(response_ids),
                logprobs=list(logprobs),
                weight_versions=[weight_version] if weight_version else [],
            )
        )
        self.units.append(Unit(list(response_ids), list(logprobs), []))

    def set_delta(self, delta_ids: list[int]) -> None:
        """The template delta after the last turn's response (observation + next header)."""
        self.units[-1].delta_ids = delta_ids

    def whole_record(self) -> TokenRecordData:
        """The whole episode: first prompt, then every response and observation. The trailing
        observation after the last response is left out: the policy never answered it."""
        record = TokenRecordData(prompt_ids=list(self.prompt_ids))
        last = len(self.units) - 1
        for index, unit in enumerate(self.units):
            record.response_ids += unit.response_ids
            record.loss_mask += [1] * len(unit.response_ids)
            record.logprobs += unit.logprobs
            if index < last:
                record.response_ids += unit.delta_ids
                record.loss_mask += [0] * len(unit.delta_ids)
                record.logprobs += [0.0] * len(unit.delta_ids)
        record.weight_versions = [v for r in self.turn_records for v in r.weight_versions]
        return record


# -- worker processes ---------------------------------------------------------------------------
# HF tokenizers hold the GIL while they encode, so tokenizing in a thread still stalls the event
# loop of a busy agent. With `tokenizer_processes` the agent tokenizes in worker processes
# instead; each worker builds its own ChatCodec per (tokenizer path, template kwargs) once.

_WORKER_CODECS: dict[tuple[str, str], ChatCodec] = {}


def codec_key(tokenizer_path: str, template_kwargs: Mapping[str, Any]) -> tuple[str, str]:
    return (tokenizer_path, json.dumps(dict(template_kwargs), sort_keys=True))


def worker_call(key: tuple[str, str], method: str, *args: Any) -> Any:
    """Runs `ChatCodec.<method>(*args)` in a worker process (module-level, so it pickles)."""
    codec = _WORKER_CODECS.get(key)
    if codec is None:
        from swerl.chassis.hf import load_tokenizer

        codec = ChatCodec(load_tokenizer(key[0]), json.loads(key[1]), key[0])
        _WORKER_CODECS[key] = codec
    return getattr(codec, method)(*args)
