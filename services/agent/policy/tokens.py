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

Storage: ids that outlive a turn are kept in `array('i')` (int32, as in TokenRecord), logprobs in
`array('d')`, not in lists. A list of ints is a container the cyclic garbage collector walks
element by element, and an agent holds millions of ids (every turn's prompt, for dynamic-history
records): with lists, one collection on the event loop's thread took 10-40 ms at 256 episodes.
Arrays are invisible to the collector, a quarter of the memory, and copy and compare as memcpy.
"""

from __future__ import annotations

import json
import operator
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, pairwise
from typing import Any

_SENTINEL = "SWERL_SENTINEL_ASSISTANT_MESSAGE_7f3a"


def token_array(ids: Iterable[int]) -> array:
    """`ids` as an int32 array (returned as is when it already is one)."""
    if isinstance(ids, array) and ids.typecode == "i":
        return ids
    return array("i", ids)


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
        # Reasoning markers as single tokens (Qwen3: <think>, </think>), and the tokens made of
        # newlines only, for `strip_reasoning` (None when the tokenizer has no such tokens).
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.think_ids = (
            (vocab["<think>"], vocab["</think>"])
            if "<think>" in vocab and "</think>" in vocab
            else None
        )
        self._newline_ids = {i for n in range(1, 5) for i in self.encode("\n" * n)}
        # Deltas are measured without the tools when the template writes the messages after an
        # assistant turn the same either way (Qwen3 declares tools in the system block only):
        # rendering every tool schema again each turn was most of a tool turn's bookkeeping.
        self._delta_kwargs = self.template_kwargs
        if "tools" in self.template_kwargs:
            plain = {k: v for k, v in self.template_kwargs.items() if k != "tools"}
            probe = [
                {"role": "tool", "tool_call_id": "call_probe", "content": "P"},
                {"role": "user", "content": "Q"},
            ]
            if self._after(probe, self.template_kwargs) == self._after(probe, plain):
                self._delta_kwargs = plain

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        generation_prompt: bool,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **(self.template_kwargs if kwargs is None else kwargs),
        )

    def _after(self, messages: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any]) -> str:
        """The text the template writes after an assistant message: `messages`, the header."""
        full = self._render(
            [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "U"},
                {"role": "assistant", "content": _SENTINEL},
                *messages,
            ],
            generation_prompt=True,
            kwargs=kwargs,
        )
        return full.split(_SENTINEL, 1)[1]

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
        after = self._after([{"role": "user", "content": text}], self._delta_kwargs)
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

    def messages_delta(
        self, response_ids: Sequence[int], messages: Sequence[Mapping[str, Any]]
    ) -> list[int]:
        """Like `observation_delta` for any messages after the response (the tool protocol's
        tool messages, or its user message when a reply called no tool): end-of-turn, the
        messages as the template writes them after an assistant turn, the next header."""
        after = self._after(messages, self._delta_kwargs)
        if not after.startswith(self.close_text) or not after.endswith(self.header_text):
            raise TemplateMismatch("messages after an assistant message are not a pure delta")
        ids = self.encode(after)
        if response_ids and response_ids[-1] == self.end_of_turn_id:
            ids = ids[1:]
        return ids

    def strip_reasoning(self, response_ids: Sequence[int]) -> list[int]:
        """A response as a template that drops earlier reasoning writes it: without its leading
        `<think>...</think>` block and the newlines after it (ids cut, nothing re-tokenized)."""
        ids = list(response_ids)
        if self.think_ids is None or not ids or ids[0] != self.think_ids[0]:
            return ids
        try:
            end = ids.index(self.think_ids[1])
        except ValueError:
            return ids  # reasoning cut off by the token limit: kept as sampled
        rest = end + 1
        while rest < len(ids) and ids[rest] in self._newline_ids:
            rest += 1
        return ids[rest:]

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
    # Top-p replay (both empty when not asked for): the kept ids of response token i are
    # top_p_token_ids[top_p_token_offsets[i]:top_p_token_offsets[i + 1]].
    top_p_token_ids: list[int] = field(default_factory=list)
    top_p_token_offsets: list[int] = field(default_factory=list)
    # Routing replay (empty when not asked for): int32 little-endian, experts_per_token values
    # for each token of prompt + response except the last.
    routed_experts: bytes = b""
    experts_per_token: int = 0
    # Prefix cache (the engine's meta_info), summed over the calls of this record's responses.
    cached_tokens: int = 0
    engine_prompt_tokens: int = 0

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
        # C-speed passes (a Python loop over a long record cost ~1 ms per 32k tokens): masks
        # are 0 or 1, and no logprob where the mask is 0 is non-zero (NaN counts as non-zero).
        if not set(self.loss_mask) <= {0, 1}:
            raise AssertionError("a loss mask value is neither 0 nor 1")
        if any(compress(self.logprobs, map(operator.not_, self.loss_mask))):
            raise AssertionError("a masked token carries a logprob")
        offsets = self.top_p_token_offsets
        if offsets or self.top_p_token_ids:
            if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != len(self.top_p_token_ids):
                raise AssertionError("top-p offsets do not frame the top-p ids per token")
            if any(b < a for a, b in pairwise(offsets)):
                raise AssertionError("top-p offsets decrease")
        if self.routed_experts:
            rows = len(self.prompt_ids) + n - 1
            if len(self.routed_experts) != 4 * rows * self.experts_per_token:
                raise AssertionError("routed experts do not cover the tokens but the last")


@dataclass
class Unit:
    """What one turn appended: the policy's ids (mask 1) and the template delta (mask 0).

    A Trajectory stores arrays here; any int and float sequences work (tests pass lists).
    """

    response_ids: Sequence[int]
    logprobs: Sequence[float]
    delta_ids: Sequence[int]
    # Top-p replay of the response tokens (len(response_ids) + 1 offsets), when asked for.
    top_p_ids: Sequence[int] | None = None
    top_p_offsets: Sequence[int] | None = None

    def __len__(self) -> int:
        return len(self.response_ids) + len(self.delta_ids)


@dataclass(frozen=True)
class RoutedExperts:
    """Routing replay of one policy call: the experts of every token of its sequence (sent
    prompt + response) but the last, as little-endian int32, `width` values per token."""

    data: bytes
    width: int

    @property
    def rows(self) -> int:
        return len(self.data) // (4 * self.width) if self.width else 0


class Trajectory:
    """The whole episode's token stream: the first prompt and one unit per turn.

    Appending is O(new tokens) (the sent prompt is kept as the array the context window made
    for this turn, not copied); `whole_records` and `turn_records` build lists once at the end.
    """

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self.prompt_ids = token_array(prompt_ids)
        self.units: list[Unit] = []
        self._sent: list[array] = []  # the exact prompt of each turn
        self._weight_versions: list[str] = []
        # Routing replay: per turn, the experts of its whole call (sent prompt + response).
        self._experts: list[RoutedExperts | None] = []
        # Per turn: (cached prompt tokens, prompt tokens) as the engine reported them.
        self._cache: list[tuple[int, int]] = []

    def add_turn(
        self,
        sent_prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        logprobs: Sequence[float],
        weight_version: str,
        *,
        top_p: tuple[Sequence[int], Sequence[int]] | None = None,
        experts: RoutedExperts | None = None,
        cache: tuple[int, int] = (0, 0),
    ) -> None:
        """Records the exact prompt sent this turn and the response (dynamic history), with
        the response's top-p sets and the call's routed experts when they were asked for, and
        the engine's prefix-cache counts (cached prompt tokens, prompt tokens) of the call."""
        if len(response_ids) != len(logprobs):
            raise ValueError("one logprob per response token")
        if top_p is not None and len(top_p[1]) != len(response_ids) + 1:
            raise ValueError("top-p offsets: one more than the response tokens")
        self._sent.append(token_array(sent_prompt_ids))
        self._weight_versions.append(weight_version)
        self._experts.append(experts)
        self._cache.append(cache)
        unit = Unit(array("i", response_ids), array("d", logprobs), array("i"))
        if top_p is not None:
            unit.top_p_ids, unit.top_p_offsets = token_array(top_p[0]), token_array(top_p[1])
        self.units.append(unit)

    @property
    def last_call(self) -> tuple[array, Sequence[int], RoutedExperts | None] | None:
        """The last turn's sent prompt, response and routed experts (None before a turn)."""
        if not self.units:
            return None
        return self._sent[-1], self.units[-1].response_ids, self._experts[-1]

    def set_delta(self, delta_ids: Sequence[int]) -> None:
        """The template delta after the last turn's response (observation + next header)."""
        self.units[-1].delta_ids = token_array(delta_ids)

    @property
    def turn_records(self) -> list[TokenRecordData]:
        """One record per turn: the exact prompt sent and the policy's response."""
        records = []
        for sent, unit, version, experts, cache in zip(
            self._sent, self.units, self._weight_versions, self._experts, self._cache, strict=True
        ):
            record = TokenRecordData(
                prompt_ids=sent.tolist(),
                response_ids=list(unit.response_ids),
                loss_mask=[1] * len(unit.response_ids),
                logprobs=list(unit.logprobs),
                weight_versions=[version] if version else [],
                cached_tokens=cache[0],
                engine_prompt_tokens=cache[1],
            )
            if unit.top_p_ids is not None and unit.top_p_offsets is not None:
                record.top_p_token_ids = list(unit.top_p_ids)
                record.top_p_token_offsets = list(unit.top_p_offsets)
            if experts is not None:
                record.routed_experts, record.experts_per_token = experts.data, experts.width
            records.append(record)
        return records

    def chain_starts(self) -> list[int]:
        """The turns that start a chain: turn 0, and every turn whose sent prompt is not
        exactly the previous turn's sent prompt + its response + the tokens appended after it
        (the context window trimmed in between, or anything else rewrote the history)."""
        starts = [0] if self.units else []
        for k in range(1, len(self.units)):
            before, unit, sent = self._sent[k - 1], self.units[k - 1], self._sent[k]
            n, r = len(before), len(unit.response_ids)
            if (
                len(sent) != n + len(unit)
                or sent[:n] != before
                or sent[n : n + r] != token_array(unit.response_ids)
                or sent[n + r :] != token_array(unit.delta_ids)
            ):
                starts.append(k)
        return starts

    def whole_records(self) -> list[TokenRecordData]:
        """The episode as one record per chain (see `chain_starts`): the chain's first sent
        prompt, then every response (mask 1) and the tokens appended after it (mask 0) up to
        the chain's last response. Each record is exactly what the policy saw and sampled, so
        its logprobs are conditional on its own tokens; an untrimmed episode is one record. The
        trailing observation after a chain's last response is left out: the policy never
        answered it within that chain."""
        starts = self.chain_starts()
        return [
            self._chain_record(first, end)
            for first, end in zip(starts, [*starts[1:], len(self.units)], strict=True)
        ]

    def whole_record(self) -> TokenRecordData:
        """The only chain of an untrimmed episode; ValueError when there are several."""
        records = self.whole_records()
        if len(records) != 1:
            raise ValueError(f"the episode is {len(records)} chains, not one record")
        return records[0]

    def _chain_record(self, first: int, end: int) -> TokenRecordData:
        """Turns first..end-1 as one record (they are one chain)."""
        record = TokenRecordData(prompt_ids=self._sent[first].tolist())
        units = self.units[first:end]
        last = len(units) - 1
        for index, unit in enumerate(units):
            record.response_ids += unit.response_ids
            record.loss_mask += [1] * len(unit.response_ids)
            record.logprobs += unit.logprobs
            if index < last:
                record.response_ids += unit.delta_ids
                record.loss_mask += [0] * len(unit.delta_ids)
                record.logprobs += [0.0] * len(unit.delta_ids)
        record.weight_versions = [v for v in self._weight_versions[first:end] if v]
        record.cached_tokens = sum(c for c, _ in self._cache[first:end])
        record.engine_prompt_tokens = sum(p for _, p in self._cache[first:end])
        if all(unit.top_p_offsets is not None for unit in units):
            record.top_p_token_ids, record.top_p_token_offsets = _chain_top_p(units)
        experts = self._experts[end - 1]
        # The chain's last call saw the whole record (prompt + every response but the last
        # token), so its routed experts cover it.
        if (
            experts is not None
            and experts.rows == len(record.prompt_ids) + len(record.response_ids) - 1
        ):
            record.routed_experts, record.experts_per_token = experts.data, experts.width
        return record


def _chain_top_p(units: Sequence[Unit]) -> tuple[list[int], list[int]]:
    """The top-p sets over a chain's record: each response's own, then an empty span per
    appended token (loss mask 0), as slime pads non-trainable tokens."""
    ids: list[int] = []
    offsets = [0]
    last = len(units) - 1
    for index, unit in enumerate(units):
        assert unit.top_p_ids is not None and unit.top_p_offsets is not None
        base = len(ids)
        ids += unit.top_p_ids
        offsets += [base + o for o in unit.top_p_offsets[1:]]
        if index < last:
            offsets += [len(ids)] * len(unit.delta_ids)
    return ids, offsets


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
