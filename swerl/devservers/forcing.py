"""A forcing proxy in front of a real vLLM engine: the engine itself samples a script's turns.

`swerl eval --policy-api vllm --script gold` runs it between the agent and the engine. Each
`/inference/v1/generate` request is matched to a script and a turn the way the replay server
matches them (swerl.devservers.replay: a script key in the decoded prompt, the turn from the
assistant headers in it), and the turn's text is added to the request as a structured-outputs
constraint; the engine then samples under that constraint, and its reply goes back to the agent
byte for byte, so swerl records the engine's own token ids and logprobs. Every other route
(/health, /v1/models, /inference/v1/abort_requests) passes through unchanged, and so does a
request no script matches (the engine samples it freely).

What vLLM 0.32.0 offers per request (site-packages `vllm/`): the token route's request carries
a full `SamplingParams` (`entrypoints/scale_out/token_in_token_out/protocol.py:162, :222`),
whose `structured_outputs` (`sampling_params.py:404`) is a `StructuredOutputsParams` with one of
json, regex, choice, grammar, json_object or structural_tag (`sampling_params.py:99-110`). Two
forcings are built on it (FORCINGS):

- `text` (the default): `choice: [text]`, which vLLM turns into an EBNF literal
  (`v1/structured_output/utils.py:438-455`, escaping done there). The bytes are forced, not the
  split into tokens: at each step every token that continues the text is allowed, and the random
  tiny model picks shorter pieces than the tokenizer does: on the bundled tasks' gold scripts
  31-42 sampled ids where the tokenizer gives 20 for the first turn, 755-2152 for 626-1859 in
  the base64 patch turn (6 Dec). The record holds ids that decode to the text but are not its
  canonical encoding; that is what the engine sampled and what swerl records, and the next
  prompt carries those ids on (token in, token out: no re-encoding). All six tasks still fit the
  tiny engine's 4096-token context (the longest trajectory 2906 tokens).
- `tokens`: a Lark grammar of the turn's canonical token ids, one `<[id]>` terminal each, which
  the `auto` backend's xgrammar compiles itself (`v1/structured_output/backend_xgrammar.py:
  123-125`, `compile_lark`): one allowed id per step, so the engine samples exactly the ids the
  tokenizer gives the text (the longest bundled trajectory 2541 tokens). It resolves the bundled
  gold scripts, but vLLM 0.32.0 fails some sequences: a bare request forcing "Step 0: reading
  more." ([8304, 220, 15, ...]) ends HTTP 500, the engine logging "grammar rejected tokens [15]",
  while xgrammar 0.2.8 alone accepts the same ids with the same grammar (6 Dec; not understood),
  so it is not the default.

After the constraint is satisfied only the model's end-of-sequence id is allowed; the tiny Qwen3's
is `<|im_end|>` (151645), so each forced turn ends where the replay's does. The logprobs the
engine returns are taken after the constraint's mask (`v1/worker/gpu_model_runner.py:4333-4337`
masks the logits before the sampler): 0 for every id a token grammar forces, and for a forced
text the log-probability among the tokens that continue it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from swerl.chassis.hf import bundled_qwen3_tokenizer_dir, load_tokenizer
from swerl.chassis.site import serve_app
from swerl.devservers.replay import script_turn

GENERATE_PATH = "/inference/v1/generate"
FORCINGS = ("text", "tokens")
# Hop-by-hop and length headers are the proxy's own to set.
_DROPPED = {"host", "content-length", "transfer-encoding", "connection"}


def token_grammar(ids: Sequence[int]) -> str:
    """A Lark grammar (llguidance's `<[id]>` token terminals) matching exactly `ids`."""
    return "start: " + " ".join(f"<[{int(t)}]>" for t in ids)


@dataclass
class ForcedCall:
    """One generate request: the script key and turn it matched (None: none, sent unforced)."""

    script_key: str | None
    turn: int
    status: int = 0


@dataclass
class ForcingStats:
    calls: list[ForcedCall] = field(default_factory=list)


class ForcingProxy:
    """Loopback HTTP proxy to the vLLM engine at `upstream` that forces `scripts`' turns."""

    def __init__(
        self,
        upstream: str,
        scripts: Mapping[str, Sequence[str]],
        *,
        forcing: str = "text",
        tokenizer_dir: str | Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        request_timeout_s: float = 3600.0,
    ) -> None:
        if forcing not in FORCINGS:
            raise ValueError(f"unknown forcing {forcing!r}; one of {', '.join(FORCINGS)}")
        self.upstream = upstream.rstrip("/")
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.forcing = forcing
        self.tokenizer = load_tokenizer(tokenizer_dir or bundled_qwen3_tokenizer_dir())
        self.host = host
        self.port = port
        self.stats = ForcingStats()
        self.url = ""
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="forcing")
        self._client: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._client = aiohttp.ClientSession(timeout=self._timeout)
        self._runner, self.port = await serve_app(app, self.host, self.port)
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._client is not None:
            await self._client.close()
            self._client = None
        self._pool.shutdown(wait=False)

    def constrain(self, body: bytes) -> tuple[bytes, ForcedCall]:
        """The request with its script turn as the constraint (unchanged when none matches)."""
        request = json.loads(body)
        ids = [int(t) for t in request.get("token_ids") or []]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        key, turn = script_turn(self.scripts, text)
        call = ForcedCall(key, turn)
        if key is None:
            return body, call
        script = self.scripts[key]
        reply = script[min(turn, len(script) - 1)]
        if self.forcing == "tokens":
            canonical = self.tokenizer.encode(reply, add_special_tokens=False)
            constraint: dict[str, Any] = {"grammar": token_grammar(canonical)}
        else:
            constraint = {"choice": [reply]}
        params = dict(request.get("sampling_params") or {})
        params["structured_outputs"] = constraint
        request["sampling_params"] = params
        return json.dumps(request, separators=(",", ":")).encode(), call

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._client is not None
        body = await request.read()
        call = None
        if request.path == GENERATE_PATH and request.method == "POST":
            loop = asyncio.get_running_loop()
            try:
                body, call = await loop.run_in_executor(self._pool, self.constrain, body)
            except (ValueError, TypeError, AttributeError) as err:
                return web.json_response(
                    {"error": {"message": f"forcing proxy: unreadable generate request: {err}"}},
                    status=400,
                )
            self.stats.calls.append(call)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
        async with self._client.request(
            request.method, self.upstream + request.path_qs, data=body, headers=headers
        ) as answer:
            raw = await answer.read()
            if call is not None:
                call.status = answer.status
            return web.Response(
                status=answer.status,
                body=raw,
                headers={"Content-Type": answer.headers.get("Content-Type", "application/json")},
            )
