"""How an episode talks to its policy: one `Policy` per episode, owning its tokens and context.

The episode loop only speaks text: `open` with the first two messages, `respond` for each turn,
`observe` with what the command printed. Everything that depends on the mode lives behind that:

- `TokenMode` (SGLang `/generate`, for training): the exact token stream. The prompt is rendered
  once, each turn appends the policy's own sampled ids with their logprobs and the template delta
  of the observation (tokens.py), the context window trims whole turns from the middle when the
  next prompt would not fit (context.py), and the episode's training records come from it,
  with each turn's top-p sets and routed experts when the episode asked SGLang for them.
- `ChatMode` (OpenAI-compatible chat, for evaluating hosted models): the message list, as text;
  no tokens, no window, no records.
"""

from __future__ import annotations

import asyncio
import copy
import sys
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from swerl.agent.policy.clients import ChatPolicy, Generation, PolicyUnavailable, TokenPolicy
from swerl.agent.policy.context import ContextExhausted, ContextPolicy, ContextWindow
from swerl.agent.policy.tokens import (
    ChatCodec,
    RoutedExperts,
    TokenRecordData,
    Trajectory,
    codec_key,
    token_array,
    worker_call,
)

T = TypeVar("T")

__all__ = ["ChatMode", "ContextExhausted", "Policy", "PolicyTurn", "TokenMode"]


@dataclass(frozen=True)
class PolicyTurn:
    """One answer of the policy, with what it cost."""

    text: str
    finish_reason: str  # stop | length | abort
    prompt_tokens: int  # 0 in chat mode
    response_tokens: int  # 0 in chat mode
    context_trimmed: bool  # the window left turns out of this prompt
    model_s: float  # preparing the prompt and waiting for the policy
    # Chat mode with tools: the server's own parsed calls (OpenAI `tool_calls`) and reasoning.
    tool_calls: tuple[dict[str, Any], ...] | None = None
    reasoning: str | None = None

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"


class Policy(Protocol):
    """One episode's policy, in one mode (token or chat); calls come one at a time."""

    async def open(self, system: str, user: str) -> int:
        """Starts the conversation; returns the first prompt's token count (0 in chat mode)."""
        ...

    async def respond(self, messages: Sequence[Mapping[str, Any]]) -> PolicyTurn:
        """The policy's next turn given the conversation so far (`messages`, which chat mode
        sends and token mode has already as tokens). An aborted turn is not recorded.
        Raises ContextExhausted when the next prompt cannot fit, PolicyUnavailable when the
        policy server fails."""
        ...

    async def observe(self, observation: str | Sequence[Mapping[str, Any]]) -> int:
        """Appends the observation after the last response (a user message's text, or the
        messages that answer it: the tool protocol's tool messages); returns the tokens it
        added."""
        ...

    @property
    def recorded_turns(self) -> int:
        """Turns with token records (always 0 in chat mode)."""
        ...

    def turn_records(self) -> list[TokenRecordData]:
        """One record per turn: the exact prompt sent and the response (dynamic history)."""
        ...

    def whole_records(self) -> list[TokenRecordData]:
        """The whole episode as one record per chain (one unless the history was trimmed)."""
        ...

    def branch(self, sampling_seed: int) -> Policy:
        """An independent copy of this policy's state (tokens, logprobs, masks, context
        window) that samples its next turns with `sampling_seed`; between turns only."""
        ...


async def _in_pool(executor: Executor | None, fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


class TokenMode:
    """Exact token ids and logprobs through SGLang `/generate`, within a context window.

    Tokenizing runs in the tokenizer worker processes when the agent has them, else in the CPU
    pool; small window work (an array copy) stays on the loop.
    """

    def __init__(
        self,
        client: TokenPolicy,
        codec: ChatCodec,
        *,
        max_context_tokens: int,
        max_new_tokens: int,
        omission_text: Callable[[int], str],
        executor: Executor | None = None,
        tokenizer_pool: Executor | None = None,
        drop_reasoning: bool = False,
    ) -> None:
        self._client = client
        # Earlier turns' reasoning left out of later prompts (agent config history_reasoning).
        self._drop_reasoning = drop_reasoning
        self._codec = codec
        self._max_context_tokens = max_context_tokens
        self._max_new_tokens = max_new_tokens
        self._omission_text = omission_text
        self._executor = executor
        self._tokenizer_pool = tokenizer_pool
        self._trajectory = Trajectory([])
        self._window: ContextWindow | None = None
        self._last_output: Sequence[int] = []

    async def open(self, system: str, user: str) -> int:
        prompt_ids = await self._tok("render_prompt", system, user)
        self._trajectory = Trajectory(prompt_ids)
        codec = self._codec

        def marker(n: int) -> list[int]:
            return codec.user_message_ids(self._omission_text(n))

        def without_reasoning(ids: Sequence[int]) -> list[int]:
            return codec.strip_reasoning(ids)

        self._window = ContextWindow(
            self._trajectory.prompt_ids,
            codec.header_ids,
            marker,
            ContextPolicy(self._max_context_tokens),
            history_ids=without_reasoning if self._drop_reasoning else None,
        )
        return len(prompt_ids)

    async def respond(self, messages: Sequence[Mapping[str, Any]]) -> PolicyTurn:
        window = self._window
        if window is None:
            raise RuntimeError("respond before open")
        max_new = self._max_new_tokens
        started = time.monotonic()
        if window.fits(max_new):
            # An array copy (~µs): cheaper than a hop to the thread pool.
            prompt, trimmed = window.next_prompt(max_new)
        else:  # a cut tokenizes the omission marker
            prompt, trimmed = await _in_pool(self._executor, window.next_prompt, max_new)
        gen = await self._client.generate(prompt, max_new)
        model_s = time.monotonic() - started
        text = ""
        if gen.finish_reason != "abort":
            text = await self._text(gen)
            top_p = None
            if gen.top_p_ids is not None and gen.top_p_offsets is not None:
                top_p = (gen.top_p_ids, gen.top_p_offsets)
            experts = None
            if gen.routed_experts is not None:
                experts = self._routed_experts(prompt, gen, gen.routed_experts)
            self._trajectory.add_turn(
                prompt,
                gen.output_ids,
                gen.logprobs,
                gen.weight_version,
                top_p=top_p,
                experts=experts,
                cache=(
                    int(gen.meta.get("cached_tokens") or 0),
                    int(gen.meta.get("prompt_tokens") or 0),
                ),
            )
            self._last_output = gen.output_ids
        return PolicyTurn(
            text=text,
            finish_reason=gen.finish_reason,
            prompt_tokens=len(prompt),
            response_tokens=len(gen.output_ids),
            context_trimmed=trimmed,
            model_s=model_s,
        )

    def _routed_experts(
        self, prompt: Sequence[int], gen: Generation, values: array
    ) -> RoutedExperts:
        """The experts of this call's whole sequence. SGLang may send only the rows from
        `routed_experts_start_len` on; the rows before come from the previous call, whose
        sequence this prompt extends."""
        start = gen.routed_experts_start_len
        rows = len(prompt) + len(gen.output_ids) - 1 - start
        if start < 0 or rows <= 0 or not values or len(values) % rows:
            raise PolicyUnavailable(
                f"routed_experts: {len(values)} values for {rows} tokens"
                f" (routed_experts_start_len {start})",
                reason="POLICY_BAD_REPLY",
            )
        width = len(values) // rows
        if sys.byteorder != "little":
            values = array("i", values)
            values.byteswap()
        data = values.tobytes()
        if start:
            last = self._trajectory.last_call
            before = last[2] if last is not None else None
            if (
                last is None
                or before is None
                or before.width != width
                or before.rows < start
                or (last[0] + token_array(last[1]))[:start] != token_array(prompt)[:start]
            ):
                raise PolicyUnavailable(
                    f"routed_experts start at token {start}, but no earlier call of the"
                    " episode covers the tokens before it",
                    reason="POLICY_BAD_REPLY",
                )
            data = before.data[: 4 * start * width] + data
        return RoutedExperts(data, width)

    async def _text(self, gen: Generation) -> str:
        if gen.output_ids:
            return str(await self._tok("decode", gen.output_ids))
        return gen.text or ""

    async def observe(self, observation: str | Sequence[Mapping[str, Any]]) -> int:
        if isinstance(observation, str):
            delta = await self._tok("observation_delta", self._last_output, observation)
        else:
            delta = await self._tok("messages_delta", self._last_output, list(observation))
        self._trajectory.set_delta(delta)
        assert self._window is not None
        self._window.append(self._trajectory.units[-1])
        return len(delta)

    @property
    def recorded_turns(self) -> int:
        return len(self._trajectory.units)

    def turn_records(self) -> list[TokenRecordData]:
        return self._trajectory.turn_records

    def whole_records(self) -> list[TokenRecordData]:
        return self._trajectory.whole_records()

    def branch(self, sampling_seed: int) -> TokenMode:
        twin = TokenMode(
            self._client.reseeded(sampling_seed),
            self._codec,
            max_context_tokens=self._max_context_tokens,
            max_new_tokens=self._max_new_tokens,
            omission_text=self._omission_text,
            executor=self._executor,
            tokenizer_pool=self._tokenizer_pool,
            drop_reasoning=self._drop_reasoning,
        )
        # One deepcopy of both, so the copy's window shares the copy's arrays as the original
        # does; the window's marker function (codec and template only) is shared as is.
        twin._trajectory, twin._window = copy.deepcopy((self._trajectory, self._window))
        twin._last_output = self._last_output
        return twin

    async def _tok(self, method: str, *args: Any) -> Any:
        """A ChatCodec call: in a tokenizer worker process when the agent has them."""
        if self._tokenizer_pool is not None:
            key = codec_key(self._codec.path, self._codec.template_kwargs)
            return await _in_pool(self._tokenizer_pool, worker_call, key, method, *args)
        return await _in_pool(self._executor, getattr(self._codec, method), *args)


class ChatMode:
    """Text through an OpenAI-compatible chat API: the messages are the whole state."""

    def __init__(self, client: ChatPolicy, *, max_new_tokens: int) -> None:
        self._client = client
        self._max_new_tokens = max_new_tokens

    async def open(self, system: str, user: str) -> int:
        return 0

    async def respond(self, messages: Sequence[Mapping[str, Any]]) -> PolicyTurn:
        started = time.monotonic()
        gen = await self._client.chat(messages, self._max_new_tokens)
        calls = gen.meta.get("tool_calls")
        reasoning = gen.meta.get("reasoning_content")
        return PolicyTurn(
            text=gen.text or "",
            finish_reason=gen.finish_reason,
            prompt_tokens=0,
            response_tokens=len(gen.output_ids),
            context_trimmed=False,
            model_s=time.monotonic() - started,
            tool_calls=tuple(calls) if isinstance(calls, list) else None,
            reasoning=reasoning if isinstance(reasoning, str) else None,
        )

    async def observe(self, observation: str | Sequence[Mapping[str, Any]]) -> int:
        return 0

    @property
    def recorded_turns(self) -> int:
        return 0

    def turn_records(self) -> list[TokenRecordData]:
        return []

    def whole_records(self) -> list[TokenRecordData]:
        raise ValueError("a chat-mode episode has no token records")

    def branch(self, sampling_seed: int) -> ChatMode:
        raise ValueError("branching needs exact tokens (SGLANG_GENERATE)")
