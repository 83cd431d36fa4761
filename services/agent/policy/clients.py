"""Policy clients: SGLang's native `/generate` (token ids in, token ids and logprobs out) for
training, and an OpenAI-compatible chat API (text only) for evaluating hosted models.

A call that failed for a reason a later attempt can cure is sent again (swerl's one retry
policy, bounded by attempts and by total time): a connection failure, an answer of HTTP 500, 502,
503 or 504, or no answer within the request's timeout. Generation has no side effect beyond the
engine's time and the agent records only the reply it gets, so this is safe, and it is what the
trainers' own client does with a failed `/generate` (slime's `http_utils._post` sends it again up
to 60 times, 1 s apart: slime/utils/http_utils.py:165-191 at 624b824a; SGLang aborts a request
whose client went away). So a policy fault shorter than the retry time (an engine restarting, a
router failing over) costs the episode a few seconds, not its run. Other answers (4xx, a reply
that cannot be read) are not retried. JSON encoding of long id lists and decoding of replies run
in the agent's CPU pool, not on the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import functools
import itertools
import json
import sys
import uuid
from array import array
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from swerl.agent.loop.pacing import IterationGate
from swerl.agent.policy.context import ContextExhausted
from swerl.agent.policy.tokens import token_array
from swerl.chassis.retry import async_retrying


class PolicyUnavailable(Exception):
    """The policy server could not be reached or answered with an error (infra, not policy)."""

    def __init__(self, message: str, reason: str = "POLICY_UNAVAILABLE") -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass
class Generation:
    """One policy turn: the exact sampled ids with their logprobs, or text (chat mode)."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length | abort
    text: str | None = None
    weight_version: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    # Top-p replay, when asked for: the kept ids of output token i are
    # top_p_ids[top_p_offsets[i]:top_p_offsets[i + 1]] (len(output_ids) + 1 offsets).
    top_p_ids: array | None = None
    top_p_offsets: array | None = None
    # Routing replay, when asked for: SGLang's routed_experts (int32 per token and layer and
    # top-k slot) for the sequence's tokens from routed_experts_start_len on, minus the last.
    routed_experts: array | None = None
    routed_experts_start_len: int = 0


class TokenPolicy(Protocol):
    async def generate(self, input_ids: Sequence[int], max_new_tokens: int) -> Generation: ...

    def reseeded(self, sampling_seed: int) -> TokenPolicy:
        """The same client for another call sequence (a branch), sampling with this seed."""
        ...


class ChatPolicy(Protocol):
    async def chat(
        self, messages: Sequence[Mapping[str, Any]], max_new_tokens: int
    ) -> Generation: ...


# Answers of a server (or of a router in front of it) that is failing for now: sent again.
RETRIED_STATUSES = frozenset({500, 502, 503, 504})
# How long a failing policy call is retried, and in how many attempts at most: about as long as
# slime's own client keeps sending a failed /generate (60 tries, 1 s apart), so swerl gives up on
# a policy no sooner than the trainer would; the waits between attempts grow to 2 s.
RETRY_ATTEMPTS = 60
RETRY_MAX_DELAY_S = 60.0


class _ServerFailing(Exception):
    """A retried HTTP status, inside the retry loop; the caller sees PolicyUnavailable."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body


def _worth_retrying(exc: BaseException) -> bool:
    return isinstance(
        exc,
        (
            aiohttp.ClientConnectorError,  # nothing reached the server
            aiohttp.ServerDisconnectedError,  # the server went away mid-call
            _ServerFailing,
            asyncio.TimeoutError,  # no answer within the request's timeout (a hung engine)
        ),
    )


def over_context_length(body: bytes) -> bool:
    """Whether an HTTP 400 body is SGLang refusing a prompt over the engine's context length:
    `TokenizerManager._validate_one_request` (sglang 0.5.23 `srt/managers/tokenizer_manager.py`
    :1307) raises "The input (...) is longer than the model's context length (...)" or
    "Requested token count exceeds the model's maximum context length of ..." (input + reserved
    >= context_len; max_new + input + reserved > context_len), which `/generate` answers with
    400 (`srt/entrypoints/http_server.py` :2246-2250). Its scheduler refuses a prompt of at
    least `max_req_input_len` tokens (the KV pool's size when that is smaller than the context)
    with "Input length (N tokens) exceeds the maximum allowed length (M tokens)"
    (`srt/managers/utils.py:282-286`), also a 400 on /generate. Either is the episode's own
    context limit, not an infra failure."""
    lowered = body.lower()
    return b"context length" in lowered or b"exceeds the maximum allowed length" in lowered


def engine_message(body: bytes) -> str:
    """An engine's error body as its own words: `{"error": {"message": ...}}` (SGLang's and
    OpenAI-style engines'), `{"message": ...}`, or else the body's start as text."""
    try:
        decoded = json.loads(body)
    except ValueError:
        decoded = None
    if isinstance(decoded, dict):
        error = decoded.get("error")
        for holder in (error, decoded):
            if isinstance(holder, dict) and isinstance(holder.get("message"), str):
                return holder["message"][:1000]
    return body[:300].decode(errors="replace")


def policy_retrying(attempts: int, max_delay_s: float) -> Any:
    """swerl's retry policy for policy HTTP calls (see the module's docstring)."""
    return async_retrying(
        max_attempts=attempts, max_delay_s=max_delay_s, max_wait_s=2.0, retry_on=_worth_retrying
    )


def _failing(status: int, body: bytes, what: str) -> PolicyUnavailable:
    return PolicyUnavailable(
        f"{what} answered HTTP {status}: {body[:300].decode(errors='replace')}",
        reason="POLICY_ERROR",
    )


async def _post(
    session: aiohttp.ClientSession, url: str, retrying: Any, what: str, **request: Any
) -> tuple[int, bytes]:
    """POSTs under the retry policy (the module's docstring): the status and body of the first
    answer that is not retried. A call still failing when the policy stops is PolicyUnavailable:
    POLICY_ERROR naming the last status, or POLICY_UNAVAILABLE naming the transport's error."""
    try:
        async for attempt in retrying:
            with attempt:
                async with session.post(url, **request) as response:
                    raw = await response.read()
                    if response.status in RETRIED_STATUSES:
                        raise _ServerFailing(response.status, raw)
                    return response.status, raw
    except _ServerFailing as err:
        raise _failing(err.status, err.body, what) from None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
        raise PolicyUnavailable(f"{what} {url} unreachable: {type(err).__name__}: {err}") from err
    raise AssertionError("unreachable")


async def post_engine(
    session: aiohttp.ClientSession,
    url: str,
    retrying: Any,
    what: str,
    *,
    over_context: Callable[[bytes], bool],
    not_found: Callable[[bytes], PolicyUnavailable],
    **request: Any,
) -> bytes:
    """One token-API call to an engine under the retry policy: the 200 answer's body. The
    engine's 400 that `over_context` recognises is the prompt over its context length
    (ContextExhausted, with the engine's words), a 404 is `not_found`'s error, and any other
    status POLICY_ERROR with the engine's message."""
    status, raw = await _post(session, url, retrying, what, **request)
    if status == 400 and over_context(raw):
        raise ContextExhausted(engine_message(raw))
    if status == 404:
        raise not_found(raw)
    if status != 200:
        raise _failing(status, raw, what)
    return raw


async def in_pool(executor: Executor | None, fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


def _finish_type(meta: Mapping[str, Any]) -> str:
    reason = meta.get("finish_reason")
    if isinstance(reason, Mapping):
        return str(reason.get("type") or "stop")
    return str(reason or "stop")


# Where SGLang puts the top-p sets in meta_info (the kept-ids names are the older spelling).
_TOP_P_ID_KEYS = ("top_p_token_ids", "top_p_kept_token_ids")
_TOP_P_OFFSET_KEYS = ("top_p_token_offsets", "top_p_kept_token_offsets")


def asks_top_p(sampling_params: Mapping[str, Any]) -> bool:
    """Whether the sampling params ask SGLang for the kept top-p token sets (slime sets
    `custom_params.return_top_p_token_ids` when --rollout-top-p < 1)."""
    custom = sampling_params.get("custom_params")
    return isinstance(custom, Mapping) and bool(custom.get("return_top_p_token_ids"))


def int32_array(value: Any) -> array:
    """An int32 meta_info array as SGLang sends it: a JSON list, or base64 of little-endian
    int32 bytes."""
    if isinstance(value, str):
        out = array("i")
        out.frombytes(base64.b64decode(value.encode("ascii"), validate=True))
        if sys.byteorder != "little":
            out.byteswap()
        return out
    if isinstance(value, list):
        return array("i", (int(x) for x in value))
    raise TypeError(f"expected a list or base64 text, got {type(value).__name__}")


def _meta_array(meta: Mapping[str, Any], keys: Sequence[str]) -> array | None:
    for key in keys:
        if meta.get(key) is not None:
            return int32_array(meta[key])
    return None


def _top_p(meta: Mapping[str, Any], n_tokens: int) -> tuple[array, array]:
    ids, offsets = _meta_array(meta, _TOP_P_ID_KEYS), _meta_array(meta, _TOP_P_OFFSET_KEYS)
    if ids is None or offsets is None:
        raise PolicyUnavailable(
            "the sampling params ask for top-p token ids (custom_params.return_top_p_token_ids)"
            " but the policy reply has no meta_info.top_p_token_ids/top_p_token_offsets",
            reason="POLICY_BAD_REPLY",
        )
    if len(offsets) != n_tokens + 1 or offsets[0] != 0 or offsets[-1] != len(ids):
        raise ValueError(
            f"top-p offsets: {len(offsets)} for {n_tokens} tokens, first"
            f" {offsets[0] if offsets else None}, last {offsets[-1] if offsets else None}"
            f" for {len(ids)} ids"
        )
    if any(b < a for a, b in itertools.pairwise(offsets)):
        raise ValueError("top-p offsets decrease")
    return ids, offsets


def parse_generate_reply(
    body: bytes, *, top_p: bool = False, routed_experts: bool = False
) -> Generation:
    """SGLang `/generate` reply → Generation; ids and logprobs from output_token_logprobs,
    and the top-p sets and routed experts when they were asked for."""
    reply = json.loads(body)
    if isinstance(reply, list):
        reply = reply[0]
    meta = reply.get("meta_info") or {}
    pairs = meta.get("output_token_logprobs")
    if pairs is None and _finish_type(meta) == "abort":
        # An abort may come back without logprob fields (slime sglang_rollout.py:206-210 and
        # miles generate_endpoint_utils.py:87-91 tolerate it): an aborted turn, not a bad reply.
        return Generation(output_ids=[], logprobs=[], finish_reason="abort")
    if pairs is None:
        raise PolicyUnavailable(
            "the policy reply has no meta_info.output_token_logprobs (return_logprob ignored?)",
            reason="POLICY_BAD_REPLY",
        )
    ids = [int(p[1]) for p in pairs]
    logprobs = [float(p[0]) if p[0] is not None else 0.0 for p in pairs]
    kept = {
        k: meta[k] for k in ("prompt_tokens", "completion_tokens", "cached_tokens") if k in meta
    }
    gen = Generation(
        output_ids=ids,
        logprobs=logprobs,
        finish_reason=_finish_type(meta),
        text=reply.get("text"),
        weight_version=str(meta.get("weight_version") or ""),
        meta=kept,
    )
    if gen.finish_reason == "abort":
        return gen  # an aborted turn is never recorded
    if top_p:
        gen.top_p_ids, gen.top_p_offsets = _top_p(meta, len(ids))
    if routed_experts:
        experts = _meta_array(meta, ("routed_experts",))
        if experts is None:
            raise PolicyUnavailable(
                "the episode asks for routed experts (PolicyConfig.return_routed_experts) but"
                " the policy reply has no meta_info.routed_experts: is the server started"
                " with routing replay (--enable-return-routed-experts)?",
                reason="POLICY_BAD_REPLY",
            )
        gen.routed_experts = experts
        gen.routed_experts_start_len = int(meta.get("routed_experts_start_len") or 0)
    return gen


class SglangPolicy:
    """Client of SGLang's native `/generate` for one episode's sampling parameters.

    One call at a time (an episode's turns): it keeps the last prompt and its retry state.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        endpoint: str,
        sampling_params: Mapping[str, Any],
        *,
        request_timeout_s: float,
        executor: Executor | None = None,
        connect_attempts: int = RETRY_ATTEMPTS,
        connect_max_delay_s: float = RETRY_MAX_DELAY_S,
        retrying: Any = None,
        headers: Mapping[str, str] | None = None,
        return_routed_experts: bool = False,
        lora_path: str = "",
        request_id_prefix: str = "",
        cache_key: str = "",
        turns: IterationGate | None = None,
    ) -> None:
        self._session = session
        # PolicyConfig.request_id_prefix: each call's `rid` is it plus a fresh uuid's hex.
        self._rid_prefix = request_id_prefix
        # Sending a request (a new connection's set-up above all) waits its turn here when many
        # policies share one event loop.
        self._turns = turns
        self._url = endpoint.rstrip("/") + "/generate"
        # Extra headers of every call (the episode's routing key).
        self._headers = {**(headers or {}), "Content-Type": "application/json"}
        self._parse = functools.partial(
            parse_generate_reply,
            top_p=asks_top_p(sampling_params),
            routed_experts=return_routed_experts,
        )
        self._extra = ',"return_routed_experts":true' if return_routed_experts else ""
        if lora_path:  # SGLang samples from the base model when a call names no adapter
            self._extra += ',"lora_path":' + json.dumps(lora_path)
        if cache_key:  # the prefix cache's namespace (PolicyConfig.cache_key)
            self._extra += ',"extra_key":' + json.dumps(cache_key)
        self._params = dict(sampling_params)
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._executor = executor
        self._sent = array("i")
        # The sent ids' JSON in pieces, one per call (each after the first starts with a comma):
        # joined only into the body, so a long prompt's JSON is not copied into a new string at
        # every step (a copy of a large string costs its page faults too: ~0.2 ms per 200 KB
        # measured, against ~0.01 ms to write it into an allocated buffer).
        self._sent_json: tuple[bytes, ...] = ()
        # Building a retry policy costs more than a turn's bookkeeping: the agent passes one
        # shared template, copied once per policy. An episode's calls come one at a time, and
        # reusing one copy leaves no garbage, while a copy per call left ~28 objects in
        # reference cycles per turn that only the cyclic collector frees (collector pauses of
        # 10-20 ms on the agent's event loop at 256 episodes).
        self._retrying = (retrying or policy_retrying(connect_attempts, connect_max_delay_s)).copy()

    def reseeded(self, sampling_seed: int) -> SglangPolicy:
        twin = copy.copy(self)
        twin._params = {**self._params, "sampling_seed": sampling_seed}
        # The retry state is per call sequence; the sent-prefix cache may be shared, as `_body`
        # replaces it rather than changing it.
        twin._retrying = self._retrying.copy()
        return twin

    def _body(self, input_ids: Sequence[int], max_new_tokens: int) -> bytes:
        # Consecutive prompts of an episode extend each other (until the context is trimmed):
        # only the new ids are serialized, so a turn costs O(new tokens) here too. The prefix
        # check compares int32 arrays (the agent's prompts are arrays already): memcmp speed.
        ids = token_array(input_ids)
        sent = self._sent
        if sent and len(ids) >= len(sent) and ids[: len(sent)] == sent:
            pieces = self._sent_json
            if len(ids) > len(sent):
                new = ",".join(map(str, ids[len(sent) :]))
                pieces = (*pieces, ("," + new if pieces else new).encode())
        else:
            pieces = (",".join(map(str, ids)).encode(),) if ids else ()
        self._sent, self._sent_json = ids, pieces
        params = json.dumps(
            {**self._params, "max_new_tokens": max_new_tokens}, separators=(",", ":")
        )
        rid = ""
        if self._rid_prefix:
            rid = ',"rid":' + json.dumps(self._rid_prefix + uuid.uuid4().hex)
        tail = f'],"sampling_params":{params},"return_logprob":true{self._extra}{rid}}}'
        return b"".join((b'{"input_ids":[', *pieces, tail.encode()))

    async def generate(self, input_ids: Sequence[int], max_new_tokens: int) -> Generation:
        body = await in_pool(self._executor, self._body, input_ids, max_new_tokens)
        if self._turns is not None:
            await self._turns.wait_turn()
        raw = await self._post(body)
        try:
            return await in_pool(self._executor, self._parse, raw)
        except (ValueError, KeyError, IndexError, TypeError) as err:
            raise PolicyUnavailable(f"unreadable policy reply: {err}", "POLICY_BAD_REPLY") from err

    async def _post(self, body: bytes) -> bytes:
        return await post_engine(
            self._session,
            self._url,
            self._retrying,
            "policy server",
            over_context=over_context_length,
            not_found=self._not_found,
            data=body,
            headers=self._headers,
            timeout=self._timeout,
        )

    def _not_found(self, raw: bytes) -> PolicyUnavailable:
        # SGLang serves /generate for every model: a 404 is a server of another API.
        return PolicyUnavailable(
            f"policy.api is SGLANG_GENERATE but {self._url} answered HTTP 404: the server"
            " does not speak SGLang's /generate (a vLLM server is POLICY_API_VLLM_GENERATE)",
            reason="POLICY_ERROR",
        )


_OPENAI_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "sampling_seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


class OpenAIChatPolicy:
    """An OpenAI-compatible `/v1/chat/completions` server; text only, for evaluation."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        endpoint: str,
        model: str,
        sampling_params: Mapping[str, Any],
        *,
        request_timeout_s: float,
        api_key: str | None = None,
        connect_attempts: int = RETRY_ATTEMPTS,
        connect_max_delay_s: float = RETRY_MAX_DELAY_S,
        headers: Mapping[str, str] | None = None,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        base = endpoint.rstrip("/")
        # The tool protocol's tools, sent in the chat API's `tools` field on every request.
        self._tools = [dict(tool) for tool in tools]
        self._url = base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")
        self._session = session
        self._model = model
        self._params = {_OPENAI_KEYS[k]: v for k, v in sampling_params.items() if k in _OPENAI_KEYS}
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._headers = dict(headers or {})
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        # One retry state per client: an episode's calls come one at a time (as SglangPolicy's).
        self._retrying = policy_retrying(connect_attempts, connect_max_delay_s)

    async def chat(self, messages: Sequence[Mapping[str, Any]], max_new_tokens: int) -> Generation:
        payload: dict[str, Any] = {
            "model": self._model,
            "messages": [_chat_message(m) for m in messages],
            "max_tokens": max_new_tokens,
            **self._params,
        }
        if self._tools:
            payload["tools"] = self._tools
        status, raw = await _post(
            self._session,
            self._url,
            self._retrying,
            "chat server",
            json=payload,
            headers=self._headers,
            timeout=self._timeout,
        )
        if status != 200:
            raise _failing(status, raw, "chat server")
        try:
            choice = json.loads(raw)["choices"][0]
            message = choice["message"]
            text = message.get("content") or ""
            calls = message.get("tool_calls")
            if calls is not None and not isinstance(calls, list):
                raise TypeError("tool_calls is not a list")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
            raise PolicyUnavailable(f"unreadable chat reply: {err}", "POLICY_BAD_REPLY") from err
        finish = str(choice.get("finish_reason") or "stop")
        meta: dict[str, Any] = {}
        if self._tools:
            meta["tool_calls"] = [c for c in calls or [] if isinstance(c, Mapping)]
        if isinstance(message.get("reasoning_content"), str):
            meta["reasoning_content"] = message["reasoning_content"]
        return Generation([], [], "length" if finish == "length" else finish, text=text, meta=meta)


def _chat_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as the chat API takes it: swerl's own keys (reasoning_content, a tool
    message's name) are left out."""
    out = {k: v for k, v in message.items() if k not in ("reasoning_content", "name")}
    if out.get("role") == "assistant" and out.get("tool_calls") and not out.get("content"):
        out["content"] = None
    return out
