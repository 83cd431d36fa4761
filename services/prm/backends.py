"""How the judge reaches its model: an SGLang router (`/generate` with token ids rendered here
with the judge model's own tokenizer and chat template) or an OpenAI-compatible chat endpoint.

A backend renders the judge's chat messages once per judgment (`render`) and samples one vote
per call (`sample`). It raises `JudgeConnectionError` when the server cannot be reached and
`JudgeBadResponse` for an HTTP error or an unreadable body; the judge adds the timeout, the
retries and the concurrency limit around it, the same for every backend.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from swerl.chassis.bounded import within
from swerl.prm.errors import JudgeBadResponse, JudgeConnectionError, JudgeReplyCut

Messages = list[dict[str, str]]
# Connecting is short; the per-vote limit covers the rest (the judge applies it).
_CONNECT_TIMEOUT_S = 10.0
_BODY_EXCERPT_CHARS = 300
_MODEL_INFO_TIMEOUT_S = 5.0
_MODEL_INFO_RETRY_S = 60.0


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt ready to sample: token ids (SGLang) or the messages (OpenAI-style)."""

    messages: Messages
    input_ids: list[int] | None = None

    @property
    def token_count(self) -> int | None:
        return None if self.input_ids is None else len(self.input_ids)


class JudgeBackend(Protocol):
    async def render(self, messages: Messages) -> RenderedPrompt: ...

    async def sample(self, prompt: RenderedPrompt, seed: int, routing_key: str = "") -> str:
        """One vote. `routing_key` (the episode id) goes in the routing-key header, so a
        consistent-hashing router sends the votes of one episode to one engine."""
        ...

    async def model_name(self) -> str: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 4096


class _HttpBackend:
    """An aiohttp session made in the running loop on first use, and JSON POSTs through it."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str] | None = None,
        routing_key_header: str = "",
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._headers = headers or {}
        self._routing_key_header = routing_key_header
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection cap here: the judge's semaphore is the one limit on calls in flight.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_TIMEOUT_S),
                headers=self._headers,
            )
        return self._session

    async def _request(
        self, method: str, path: str, body: Any = None, routing_key: str = ""
    ) -> dict[str, Any]:
        url = self._base_url + path
        headers = None
        if routing_key and self._routing_key_header:
            headers = {self._routing_key_header: routing_key}
        try:
            async with self._client().request(method, url, json=body, headers=headers) as response:
                text = await response.text()
                status = response.status
        except aiohttp.ClientConnectionError as exc:
            raise JudgeConnectionError(f"judge server {url} unreachable: {exc!r}") from exc
        except (aiohttp.ClientError, ValueError) as exc:  # A broken answer: not worth a retry.
            raise JudgeBadResponse(
                f"judge server {url} sent an unreadable answer: {exc!r}"
            ) from exc
        if status != 200:
            raise JudgeBadResponse(
                f"judge server {url} answered HTTP {status}: {text[:_BODY_EXCERPT_CHARS]}"
            )
        try:
            parsed = json.loads(text)
        except ValueError as exc:
            raise JudgeBadResponse(f"judge server {url} sent invalid JSON") from exc
        if not isinstance(parsed, dict):
            raise JudgeBadResponse(f"judge server {url} sent {type(parsed).__name__}, not object")
        return parsed

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


@dataclass
class _ModelNameCache:
    name: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # When to ask the server again after it could not say (monotonic seconds).
    next_ask: float = 0.0


class SglangBackend(_HttpBackend):
    """SGLang router `/generate`: ids from the judge's own tokenizer in, text out."""

    def __init__(
        self,
        base_url: str,
        tokenizer_path: Path,
        sampling: SamplingConfig,
        *,
        model_name: str = "",
        chat_template_kwargs: dict[str, Any] | None = None,
        routing_key_header: str = "",
    ) -> None:
        super().__init__(base_url, routing_key_header=routing_key_header)
        from swerl.chassis.hf import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_path)
        self._sampling = sampling
        self._template_kwargs = dict(chat_template_kwargs or {})
        self._model = _ModelNameCache(model_name)

    def render_ids(self, messages: Messages) -> list[int]:
        """The judge model's token ids for `messages` (CPU work: call it off the event loop)."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self._template_kwargs
        )
        # The template already wrote the special tokens it wants.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def render(self, messages: Messages) -> RenderedPrompt:
        ids = await asyncio.to_thread(self.render_ids, messages)
        return RenderedPrompt(messages=messages, input_ids=ids)

    async def sample(self, prompt: RenderedPrompt, seed: int, routing_key: str = "") -> str:
        if prompt.input_ids is None:
            raise ValueError("SglangBackend samples rendered token ids only")
        body = {
            "input_ids": prompt.input_ids,
            "sampling_params": {
                "temperature": self._sampling.temperature,
                "top_p": self._sampling.top_p,
                "max_new_tokens": self._sampling.max_new_tokens,
                "sampling_seed": seed,
            },
        }
        answer = await self._request("POST", "/generate", body, routing_key)
        text = answer.get("text")
        if not isinstance(text, str):
            raise JudgeBadResponse("judge /generate answer has no text")
        meta = answer.get("meta_info")
        finish = meta.get("finish_reason") if isinstance(meta, dict) else None
        _check_finished(finish.get("type") if isinstance(finish, dict) else finish)
        return text

    async def model_name(self) -> str:
        """The judge's model path as its server reports it, or the configured name.

        Asked once; a server that cannot say is asked again a minute later at the earliest,
        and never for longer than a few seconds, since every judgment waits for the answer.
        """
        cache = self._model
        if cache.name or time.monotonic() < cache.next_ask:
            return cache.name
        async with cache.lock:
            if cache.name or time.monotonic() < cache.next_ask:
                return cache.name
            try:
                info = await within(self._request("GET", "/get_model_info"), _MODEL_INFO_TIMEOUT_S)
            except (JudgeConnectionError, JudgeBadResponse, asyncio.TimeoutError):
                cache.next_ask = time.monotonic() + _MODEL_INFO_RETRY_S
                return ""
            cache.name = str(info.get("model_path") or "")
            if not cache.name:
                cache.next_ask = time.monotonic() + _MODEL_INFO_RETRY_S
            return cache.name


class OpenAIChatBackend(_HttpBackend):
    """An OpenAI-compatible `/v1/chat/completions`: the server applies its model's template."""

    def __init__(
        self,
        base_url: str,
        model: str,
        sampling: SamplingConfig,
        *,
        api_key: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        routing_key_header: str = "",
    ) -> None:
        url = base_url.rstrip("/")
        super().__init__(
            url if url.endswith("/v1") else url + "/v1",
            {"Authorization": f"Bearer {api_key}"} if api_key else None,
            routing_key_header,
        )
        self._model_name = model
        self._reported_model = ""
        self._sampling = sampling
        self._template_kwargs = dict(chat_template_kwargs or {})

    async def render(self, messages: Messages) -> RenderedPrompt:
        return RenderedPrompt(messages=messages)

    async def sample(self, prompt: RenderedPrompt, seed: int, routing_key: str = "") -> str:
        body: dict[str, Any] = {
            "model": self._model_name,
            "messages": prompt.messages,
            "temperature": self._sampling.temperature,
            "top_p": self._sampling.top_p,
            "max_tokens": self._sampling.max_new_tokens,
            "seed": seed,
            "n": 1,
        }
        if self._template_kwargs:
            body["chat_template_kwargs"] = self._template_kwargs
        answer = await self._request("POST", "/chat/completions", body, routing_key)
        try:
            content = answer["choices"][0]["message"].get("content")
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise JudgeBadResponse("judge chat completion has no choices[0].message") from exc
        self._reported_model = str(answer.get("model") or "")
        _check_finished(answer["choices"][0].get("finish_reason"))
        return content if isinstance(content, str) else ""

    async def model_name(self) -> str:
        return self._reported_model or self._model_name


def _check_finished(finish: Any) -> None:
    """Raises JudgeReplyCut for a reply the engine aborted or cut at max_new_tokens (SGLang's
    `meta_info.finish_reason.type`, OpenAI's `finish_reason`): its text is not a verdict."""
    if finish in ("length", "abort"):
        raise JudgeReplyCut(f"the judge's reply ended with finish_reason {finish!r}: not a vote")
