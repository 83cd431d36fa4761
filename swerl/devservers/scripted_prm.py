"""A scripted judge model server for tests and demos: SGLang's `/generate` (and an OpenAI-style
`/v1/chat/completions`) over real HTTP, answering from a script instead of a model.

Rules pick replies by a substring of the prompt (decoded with the judge tokenizer the server is
given, so a test can check what the PRM service really sent); each rule plays its replies in
order, repeating the last. A reply is a text (a boxed verdict, malformed text), an HTTP error, a
dropped connection, or a hang. The server records every request and the most requests it ever
had in flight at once, which is how tests measure the PRM service's concurrency limit.

    judge = ScriptedJudge(tokenizer_dir, rules=[Rule("rm -rf", [verdict(-1)])])
    port = await judge.start()
    ...
    await judge.stop()
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

DEFAULT_MODEL_NAME = "swerl-scripted-judge"


@dataclass(frozen=True)
class Reply:
    """What the server does with one request.

    `text` is the judge's answer; `status` other than 200 answers that HTTP error instead; `drop`
    closes the connection without answering; `hang` never answers (until the client gives up or
    the server stops); `delay_s` waits before answering; `raw_body` is sent as the body verbatim
    (a broken server's answer).
    """

    text: str = ""
    status: int = 200
    drop: bool = False
    hang: bool = False
    delay_s: float = 0.0
    raw_body: str | bytes | None = None
    # How the engine says the reply ended: "stop", "length" (cut at max_new_tokens), "abort".
    finish: str = "stop"


def verdict(value: int, reasoning: str = "The step looks at the right code.", **kw: Any) -> Reply:
    """A well-formed answer ending in `\\boxed{+1}` or `\\boxed{-1}`."""
    sign = "+1" if value > 0 else "-1"
    return Reply(text=f"{reasoning}\n\\boxed{{{sign}}}", **kw)


HANG = Reply(hang=True)
DROP = Reply(drop=True)


@dataclass
class Rule:
    """Replies for prompts containing `contains`, played in order (the last one repeats)."""

    contains: str
    replies: Sequence[Reply]
    _played: int = 0

    def next_reply(self) -> Reply:
        reply = self.replies[min(self._played, len(self.replies) - 1)]
        self._played += 1
        return reply


@dataclass
class RecordedRequest:
    """One request as received; `prompt_text` is decoded on first use (decoding is the
    server's main CPU cost, and a server without rules never needs it)."""

    path: str
    input_ids: list[int] | None
    seed: int | None
    body: dict[str, Any] = field(repr=False)
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    decode: Callable[[], str] = field(repr=False, default=str)

    @functools.cached_property
    def prompt_text(self) -> str:
        return self.decode()


class ScriptedJudge:
    """The scripted server. Not thread-safe: run it on the test's event loop."""

    def __init__(
        self,
        tokenizer_path: Path | str | None = None,
        *,
        rules: Sequence[Rule] = (),
        default: Sequence[Reply] = (),
        model_name: str = DEFAULT_MODEL_NAME,
        model_info: Reply | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.tokenizer: Any = None
        if tokenizer_path is not None:
            from swerl.chassis.hf import load_tokenizer

            self.tokenizer = load_tokenizer(tokenizer_path)
        self.rules = list(rules)
        self.default = Rule("", list(default) or [verdict(1)])
        self.model_name = model_name
        # How /get_model_info answers: None = the model name; a Reply can hang or fail it.
        self.model_info = model_info
        self.model_info_requests = 0
        self.host = host
        self.requests: list[RecordedRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._release = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._ids = itertools.count()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, port: int = 0) -> int:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_get("/health", self._health)
        # Cancel a hung handler when its client goes away, as a real server's abort would.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.port

    async def stop(self) -> None:
        self._release.set()  # Hung requests answer now, so shutdown does not wait for them.
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _reply_for(self, recorded: RecordedRequest) -> Reply:
        for rule in self.rules:
            if rule.contains in recorded.prompt_text:
                return rule.next_reply()
        return self.default.next_reply()

    async def _play(self, request: web.Request, recorded: RecordedRequest) -> Reply | None:
        """Records the request and carries out its reply; None when the reply was a drop."""
        self.requests.append(recorded)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            reply = self._reply_for(recorded)
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            if reply.hang:
                await self._release.wait()
            if reply.drop:
                if request.transport is not None:
                    request.transport.abort()
                return None
            return reply
        finally:
            self.in_flight -= 1

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        ids = body.get("input_ids")
        seed = (body.get("sampling_params") or {}).get("sampling_seed")
        recorded = RecordedRequest(
            "/generate", ids, seed, body, dict(request.headers), functools.partial(self._text, body)
        )
        reply = await self._play(request, recorded)
        if reply is None:
            return web.Response(status=500)  # The connection is gone; nobody reads this.
        if reply.raw_body is not None:
            return _raw(reply)
        if reply.status != 200:
            return web.json_response({"error": {"message": "scripted error"}}, status=reply.status)
        output_ids = (
            self.tokenizer.encode(reply.text, add_special_tokens=False) if self.tokenizer else []
        )
        return web.json_response(
            {
                "text": reply.text,
                "output_ids": output_ids,
                "meta_info": {
                    "id": f"scripted-{next(self._ids)}",
                    "finish_reason": {"type": reply.finish, "matched": None},
                    "prompt_tokens": len(ids) if isinstance(ids, list) else 0,
                    "completion_tokens": len(output_ids),
                },
            }
        )

    def _text(self, body: dict[str, Any]) -> str:
        ids = body.get("input_ids")
        if isinstance(ids, list) and self.tokenizer is not None:
            return str(self.tokenizer.decode(ids, skip_special_tokens=False))
        return str(body.get("text", ids))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        messages = body.get("messages") or []
        text = "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        recorded = RecordedRequest(
            "/v1/chat/completions",
            None,
            body.get("seed"),
            body,
            dict(request.headers),
            functools.partial(str, text),
        )
        reply = await self._play(request, recorded)
        if reply is None:
            return web.Response(status=500)
        if reply.raw_body is not None:
            return _raw(reply)
        if reply.status != 200:
            return web.json_response({"error": {"message": "scripted error"}}, status=reply.status)
        return web.json_response(
            {
                "id": f"chatcmpl-scripted-{next(self._ids)}",
                "object": "chat.completion",
                "model": self.model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": reply.text},
                        "finish_reason": reply.finish,
                    }
                ],
            }
        )

    async def _model_info(self, request: web.Request) -> web.StreamResponse:
        self.model_info_requests += 1
        reply = self.model_info
        if reply is not None and reply.hang:
            await self._release.wait()
        if reply is not None and reply.status != 200:
            return web.json_response({"error": {"message": "scripted error"}}, status=reply.status)
        return web.json_response(
            {"model_path": self.model_name, "tokenizer_path": None, "is_generation": True}
        )

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok")


def _raw(reply: Reply) -> web.Response:
    body = reply.raw_body
    data = body.encode() if isinstance(body, str) else (body or b"")
    return web.Response(body=data, status=reply.status, content_type="application/json")
