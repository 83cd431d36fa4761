"""Policy client of vLLM's token-in/token-out `/inference/v1/generate` (POLICY_API_VLLM_GENERATE).

What SglangPolicy is to SGLang's `/generate`: exact token ids in, the sampled ids with their
logprobs out, so an episode trains on exactly what the engine sampled. vLLM serves the route when
started with `--enable-scale-out` (vllm 0.32.0 `entrypoints/scale_out/token_in_token_out/
api_router.py:46-73`; request and reply models in `protocol.py` there: GenerateRequest :162,
GenerateTokensChoice :409, WeightVersionSpan `vllm/outputs.py:42`).

An episode's sampling params keep SGLang's names (the contract's), mapped here to vLLM's
`SamplingParams` (`vllm/sampling_params.py:268`):

    max_new_tokens -> max_tokens (the turn's cap, set per call)
    min_new_tokens -> min_tokens
    temperature, top_p, min_p, stop, stop_token_ids, ignore_eos -> the same
    frequency_penalty, presence_penalty, repetition_penalty -> the same
    top_k -> top_k (SGLang's -1, off, is vLLM's 0)
    skip_special_tokens, spaces_between_special_tokens -> the same (text only; ids are kept)
    no_stop_trim -> include_stop_str_in_output (text only; ids are kept)
    sampling_seed -> seed (a branch's reseed too)
    logit_bias -> logit_bias (token ids as keys)
    json_schema, regex, ebnf -> structured_outputs.json, .regex, .grammar (one at most)
    n -> refused unless 1 (one reply per call)
    custom_params -> refused (top-p replay is SGLang's)

Any other key is refused (vLLM would ignore it silently and sample with its default): the agent
and the gateway check the params when an episode or session starts, before any sandbox is leased.

vLLM's finish reasons are swerl's: `stop`, `length` and `abort` as they are; `repetition` (the
engine's own repetition detection ended it) is a stop. A call cancelled on swerl's side (the
trainer aborted the session, the episode was cancelled) is aborted on the engine too: vLLM's
`/inference/v1/abort_requests` with the call's request id, which the engine names
`generate-tokens-<id>` (serving.py:194-196); so is a trainer's own abort of one of swerl's
requests, which then comes back as finish reason `abort`. The engine's refusal of a prompt over
its context length (HTTP 400 "... longer than the maximum model length ...") is the episode's
context limit (ContextExhausted with the engine's words), not an infra failure. Retries are
SglangPolicy's (clients.py: the same statuses, attempts and waits).
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import aiohttp

from swerl.agent.loop.pacing import IterationGate
from swerl.agent.policy.clients import (
    RETRY_ATTEMPTS,
    RETRY_MAX_DELAY_S,
    Generation,
    PolicyUnavailable,
    engine_message,
    in_pool,
    policy_retrying,
    post_engine,
)
from swerl.agent.policy.tokens import token_array

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
# serving.py:194-196: the engine's id of a request is this prefix plus the id the body gives.
ENGINE_REQUEST_PREFIX = "generate-tokens-"
# The waits (s) before each send of an abort, the first as swerl stops waiting for the call.
ABORT_AGAIN_S = (0.0, 1.0, 2.0, 5.0)

# SGLang's key -> vLLM's, for the keys whose value passes as it is.
_RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "sampling_seed": "seed",
}
# SGLang's constrained-decoding keys -> vLLM's structured_outputs fields.
_STRUCTURED = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}
_REFUSED = {
    "custom_params": "top-p replay (custom_params) needs SGLANG_GENERATE",
}


class UnsupportedSamplingParam(ValueError):
    """A sampling param vLLM has no counterpart for; `key` names it."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"sampling_params.{key}: {why}")
        self.key = key
        self.message = str(self)


def vllm_sampling_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The episode's SGLang-named sampling params as vLLM's (the module's table); raises
    UnsupportedSamplingParam naming the first key that has no counterpart."""
    out: dict[str, Any] = {}
    structured: dict[str, Any] = {}
    for key in sorted(params):
        value = params[key]
        if key in _REFUSED:
            raise UnsupportedSamplingParam(key, _REFUSED[key])
        if key == "n":
            if value not in (1, 1.0):
                raise UnsupportedSamplingParam(key, "an episode samples one reply per call (n=1)")
            continue
        if key == "top_k":
            out["top_k"] = 0 if value == -1 else value  # SGLang's "off" is -1, vLLM's 0
        elif key == "logit_bias":
            if not isinstance(value, Mapping):
                raise UnsupportedSamplingParam(key, "must map token ids to biases")
            try:
                out["logit_bias"] = {int(k): float(v) for k, v in value.items()}
            except (TypeError, ValueError):
                raise UnsupportedSamplingParam(key, "must map token ids to biases") from None
        elif key in _STRUCTURED:
            structured[_STRUCTURED[key]] = value
        elif key in _RENAMED:
            out[_RENAMED[key]] = value
        else:
            raise UnsupportedSamplingParam(
                key, "vLLM has no such sampling param (docs/engines.md lists the mapped keys)"
            )
    if len(structured) > 1:
        raise UnsupportedSamplingParam(
            sorted(k for k in params if k in _STRUCTURED)[1],
            "vLLM takes one of json_schema, regex and ebnf",
        )
    if structured:
        out["structured_outputs"] = structured
    return out


def over_max_model_len(body: bytes) -> bool:
    """Whether an HTTP 400 body is vLLM refusing a prompt over its max model length: "The
    decoder prompt (length N) [plus the number of requested output tokens] is longer than the
    maximum model length of M" (vllm 0.32.0 `v1/engine/input_processor.py:590`), or "This
    model's maximum context length is ..." (`renderers/params.py:389, 528`). A prompt that fits
    but leaves less room than max_tokens is not refused: vLLM samples up to the limit and
    finishes `length`."""
    lowered = body.lower()
    return b"maximum model length" in lowered or b"maximum context length" in lowered


def _not_found(url: str, raw: bytes) -> PolicyUnavailable:
    """A 404: vLLM's own for an unknown model (`{"error": {"param": "model", ...}}`), or a
    server with no such route, which is one that speaks another API."""
    try:
        error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict) and error.get("param") == "model":
        return PolicyUnavailable(
            f"the vLLM server at {url} serves no such model: {engine_message(raw)}",
            reason="POLICY_ERROR",
        )
    return PolicyUnavailable(
        f"policy.api is VLLM_GENERATE but {url} answered HTTP 404 for {GENERATE_PATH}: it does"
        " not speak vLLM's token API (an SGLang server is POLICY_API_SGLANG_GENERATE; a vLLM"
        " server needs --enable-scale-out)",
        reason="POLICY_ERROR",
    )


_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "stop"}


def parse_vllm_reply(body: bytes) -> Generation:
    """A `/inference/v1/generate` reply (output_mode tokens, logprobs 0) → Generation."""
    reply = json.loads(body)
    choice = reply["choices"][0]
    finish = str(choice.get("finish_reason") or "stop")
    if finish not in _FINISH:
        raise ValueError(f"unknown finish_reason {finish!r}")
    ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content")
    if finish == "abort" and not ids:
        return Generation(output_ids=[], logprobs=[], finish_reason="abort")
    if content is None:
        raise PolicyUnavailable(
            "the vLLM reply has no logprobs.content (sampling_params.logprobs ignored?)",
            reason="POLICY_BAD_REPLY",
        )
    follows = len(content) == len(ids) and all(
        int(c["token_id"]) == t for c, t in zip(content, ids, strict=True)
    )
    if not follows:
        raise ValueError("logprobs.content does not follow token_ids")
    versions = [str(span["version"]) for span in choice.get("weight_versions") or []]
    usage = reply.get("usage") or {}
    meta: dict[str, Any] = {
        k: usage[k] for k in ("prompt_tokens", "completion_tokens") if usage.get(k) is not None
    }
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        meta["cached_tokens"] = cached
    meta["engine_request_id"] = reply.get("request_id", "")
    return Generation(
        output_ids=ids,
        logprobs=[float(c["logprob"]) for c in content],
        finish_reason=_FINISH[finish],
        # One version per sampled span in the records (TokenRecord.weight_versions): the
        # engine's, or its versions in order when the weights changed during the call.
        weight_version=",".join(dict.fromkeys(versions)),
        meta=meta,
    )


# Abort calls outlive the cancelled call that sends them: kept here until done.
_ABORTS: set[asyncio.Task[None]] = set()


class VllmPolicy:
    """Client of vLLM's `/inference/v1/generate` for one episode's (or session's) calls.

    One call at a time, as SglangPolicy. `request_key` (the episode or session id) starts every
    request id, so an engine's log and a trainer's abort can tell whose call it is.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        endpoint: str,
        sampling_params: Mapping[str, Any],
        *,
        request_timeout_s: float,
        model: str = "",
        lora_path: str = "",
        executor: Executor | None = None,
        connect_attempts: int = RETRY_ATTEMPTS,
        connect_max_delay_s: float = RETRY_MAX_DELAY_S,
        retrying: Any = None,
        headers: Mapping[str, str] | None = None,
        turns: IterationGate | None = None,
        request_key: str = "swerl",
    ) -> None:
        self._session = session
        self._turns = turns
        self._base = endpoint.rstrip("/")
        self._url = self._base + GENERATE_PATH
        self._headers = {**(headers or {}), "Content-Type": "application/json"}
        self._params = vllm_sampling_params(sampling_params)
        # vLLM serves a LoRA adapter under its own name (`--lora-modules NAME=PATH`, or loaded
        # at run time): a call names it as its `model`. Neither: the server's one model.
        self._model = lora_path or model
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._executor = executor
        self._key = request_key
        self._retrying = (retrying or policy_retrying(connect_attempts, connect_max_delay_s)).copy()

    def reseeded(self, sampling_seed: int) -> VllmPolicy:
        twin = copy.copy(self)
        twin._params = {**self._params, "seed": sampling_seed}
        twin._retrying = self._retrying.copy()
        return twin

    def _body(self, request_id: str, input_ids: Sequence[int], max_new_tokens: int) -> bytes:
        params = {**self._params, "max_tokens": max_new_tokens, "logprobs": 0}
        request: dict[str, Any] = {
            "request_id": request_id,
            "token_ids": token_array(input_ids).tolist(),
            "sampling_params": params,
        }
        if self._model:
            request["model"] = self._model
        return json.dumps(request, separators=(",", ":")).encode()

    async def generate(self, input_ids: Sequence[int], max_new_tokens: int) -> Generation:
        request_id = f"{self._key}-{uuid.uuid4().hex[:16]}"
        body = await in_pool(self._executor, self._body, request_id, input_ids, max_new_tokens)
        if self._turns is not None:
            await self._turns.wait_turn()
        try:
            raw = await self._post(body)
        except asyncio.CancelledError:
            self._abort(request_id)
            raise
        try:
            return await in_pool(self._executor, parse_vllm_reply, raw)
        except (ValueError, KeyError, IndexError, TypeError) as err:
            raise PolicyUnavailable(f"unreadable vLLM reply: {err}", "POLICY_BAD_REPLY") from err

    def _abort(self, request_id: str) -> None:
        """Asks the engine to stop sampling a call swerl no longer waits for.

        vLLM answers every abort 200 and drops one for an id it does not hold yet (its API
        server may still be admitting the request: async_llm.py's `abort` finds no state), so
        the abort is sent again a few times over some seconds; one for an id that has ended is
        a no-op too. (vLLM also aborts a request whose client went away, but a proxy or router
        in between may keep that connection open.)"""
        body = {"request_ids": [ENGINE_REQUEST_PREFIX + request_id]}

        async def send() -> None:
            for delay_s in ABORT_AGAIN_S:
                await asyncio.sleep(delay_s)
                try:
                    timeout = aiohttp.ClientTimeout(total=10)
                    async with self._session.post(
                        self._base + ABORT_PATH, json=body, headers=self._headers, timeout=timeout
                    ) as response:
                        await response.read()
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, RuntimeError):
                    return  # best effort: the engine is gone or the session closed

        task = asyncio.ensure_future(send())
        _ABORTS.add(task)
        task.add_done_callback(_ABORTS.discard)

    async def _post(self, body: bytes) -> bytes:
        return await post_engine(
            self._session,
            self._url,
            self._retrying,
            "vLLM server",
            over_context=over_max_model_len,
            not_found=lambda raw: _not_found(self._base, raw),
            data=body,
            headers=self._headers,
            timeout=self._timeout,
        )
