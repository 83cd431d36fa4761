"""The real vLLM engine of the `vllm` tests, and a recording proxy in front of it.

scripts/test starts one engine for the whole run (scripts/vllm-serve, the tiny model of
scripts/vllm-env) and exports SWERL_VLLM_URL; the tests' fixture waits for its /health here, so
the rest of the suite does not wait for it. As with Ray (SWERL_RAY_SITE), the tests are skipped
when the variable is unset and fail, never skip, when it is set and the engine is not healthy
within SWERL_VLLM_START_S (tests/README.md).

`RecordingProxy` sits between swerl and the engine and keeps every raw request and response
body, so a test checks swerl's records against what the engine itself was sent and returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from swerl.chassis.site import serve_app

# How long the fixture waits for a starting engine: its environment's build on a fresh machine
# (~2 min; scripts/test builds it in the background), its start (~40 s on an idle 2-core machine)
# beside the static checks or other tests, and the first generate's warm-up (~20 s).
START_S = float(os.environ.get("SWERL_VLLM_START_S", "600"))


@dataclass(frozen=True)
class VllmEngine:
    url: str
    # The served model's name and the folder it was loaded from (its tokenizer, for swerl).
    model: str
    model_dir: str
    max_model_len: int


def _get(url: str, timeout_s: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return bytes(response.read())


def engine_queue(engine: VllmEngine) -> tuple[float, float]:
    """The engine's own count of requests running and waiting (its /metrics gauges
    `vllm:num_requests_running` and `vllm:num_requests_waiting`)."""
    counts = {"running": 0.0, "waiting": 0.0}
    for line in _get(engine.url + "/metrics").decode().splitlines():
        for key in counts:
            if line.startswith(f"vllm:num_requests_{key}{{"):
                counts[key] += float(line.rsplit(" ", 1)[1])
    return counts["running"], counts["waiting"]


# How long a test waits for its turn on the engine (engine_turn).
TURN_WAIT_S = 900.0


@contextlib.contextmanager
def engine_turn(*, alone: bool) -> Iterator[None]:
    """A test's hold on the run's one engine, across pytest-xdist's workers: a shared hold, or
    with `alone` the engine to itself (a `vllm_alone` test: tests/conftest.py takes the hold for
    every test that uses `vllm_engine`). The engine's gauges count every worker's requests, so
    a test that waits for *its* request to be sampled (wait_until_sampling) must be alone: once
    a 3,500-token call finished before the test's abort, its wait having been held up by
    another worker's queued requests. An flock on a file named after the engine's URL."""
    key = hashlib.sha256(os.environ.get("SWERL_VLLM_URL", "").encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"swerl-vllm-engine-{key}.lock"
    kind = fcntl.LOCK_EX if alone else fcntl.LOCK_SH
    with open(path, "a+b") as handle:
        deadline = time.monotonic() + TURN_WAIT_S
        while True:
            try:
                fcntl.flock(handle, kind | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no turn on the engine within {TURN_WAIT_S:g} s ({path})"
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


async def wait_until_sampling(engine: VllmEngine, timeout_s: float = 120.0) -> None:
    """Until the engine's scheduler runs every request it was sent (at least one, none
    waiting): a request the proxy has forwarded may still be queued, or in the engine's
    first-call warm-up, and an abort that comes before the engine holds it is a no-op. Only
    for a test that has the engine to itself (`vllm_alone`): the gauges are the engine's."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        running, waiting = await asyncio.to_thread(engine_queue, engine)
        if running >= 1 and not waiting:
            return
        assert asyncio.get_running_loop().time() < deadline, "the engine never ran the request"
        await asyncio.sleep(0.2)


def _log_tail() -> str:
    log = os.environ.get("SWERL_VLLM_LOG", "")
    if not log or not Path(log).is_file():
        return "(no SWERL_VLLM_LOG)"
    return "\n".join(Path(log).read_text(errors="replace").splitlines()[-30:])


def _job_ended() -> bool:
    """Whether the job serving the engine (SWERL_VLLM_PID, set by scripts/test: its environment's
    build, then the engine) has exited; a zombie counts, nobody has waited for it yet."""
    pid = os.environ.get("SWERL_VLLM_PID", "")
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_for_engine(start_s: float = START_S) -> VllmEngine:
    """The engine at SWERL_VLLM_URL once healthy and warm; skips when the variable is unset and
    fails when the engine is not up within start_s."""
    url = os.environ.get("SWERL_VLLM_URL", "").rstrip("/")
    if not url:
        pytest.skip("no vLLM engine (scripts/test starts one; tests/README.md: SWERL_VLLM_URL)")
    deadline = time.monotonic() + start_s
    last = ""
    while True:
        try:
            if _get(url + "/health") is not None:
                break
        except (OSError, urllib.error.URLError) as err:
            last = f"{type(err).__name__}: {err}"
        if _job_ended():
            pytest.fail(
                f"SWERL_VLLM_URL={url} is set but the job serving it"
                f" (pid {os.environ['SWERL_VLLM_PID']}) has ended; its log's end:\n{_log_tail()}",
                pytrace=False,
            )
        if time.monotonic() > deadline:
            pytest.fail(
                f"SWERL_VLLM_URL={url} is set but the engine is not healthy after {start_s:.0f} s"
                f" ({last}); its log's end:\n{_log_tail()}",
                pytrace=False,
            )
        time.sleep(1.0)
    served = json.loads(_get(url + "/v1/models"))["data"][0]
    engine = VllmEngine(
        url=url,
        model=served["id"],
        model_dir=served["root"],
        max_model_len=int(served["max_model_len"]),
    )
    # The first generate of a fresh engine takes ~20 s (its warm-up): spent here, once.
    warm = json.dumps(
        {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1}, "model": engine.model}
    ).encode()
    request = urllib.request.Request(
        url + "/inference/v1/generate", warm, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=max(start_s, 60.0)):
        pass
    return engine


@dataclass
class Exchange:
    """One call through the proxy: its path, raw request body, status and raw response body."""

    path: str
    request: bytes
    status: int
    response: bytes

    def request_json(self) -> Any:
        return json.loads(self.request)

    def response_json(self) -> Any:
        return json.loads(self.response)


@dataclass
class RecordingProxy:
    """A loopback HTTP proxy to `upstream` that keeps every exchange (port 0, this loop)."""

    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)
    # The request bodies as they arrive, answered or not (a call still being sampled).
    started: list[tuple[str, bytes]] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None
    _client: aiohttp.ClientSession | None = None

    async def start(self) -> str:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._client = aiohttp.ClientSession()
        self._runner, port = await serve_app(app, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._client is not None
        body = await request.read()
        self.started.append((request.path, body))
        headers = {k: v for k, v in request.headers.items() if k.lower() in _KEPT_HEADERS}
        # The engine's answer is read to its end even when swerl's side went away (a cancelled
        # call): the test reads what the engine returned for it (an abort's finish reason).
        forward = asyncio.ensure_future(self._send(request, body, headers))
        status, raw, content_type = await asyncio.shield(forward)
        return web.Response(status=status, body=raw, content_type=content_type)

    async def _send(
        self, request: web.Request, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, str]:
        assert self._client is not None
        async with self._client.request(
            request.method, self.upstream + request.path_qs, data=body, headers=headers
        ) as answer:
            raw = await answer.read()
            exchange = Exchange(request.path, body, answer.status, raw)
            self.exchanges.append(exchange)
            return answer.status, raw, answer.content_type

    def generates(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.path == "/inference/v1/generate"]

    def aborts(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.path == "/inference/v1/abort_requests"]

    async def wait_for(self, check: Any, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            assert time.monotonic() < deadline, "the proxy did not see the expected exchange"
            await asyncio.sleep(0.05)


_KEPT_HEADERS = {"content-type", "x-request-id", "authorization", "accept"}


def sampled_spans(proxy: RecordingProxy) -> list[tuple[list[int], list[int], list[float]]]:
    """Each answered generate as the engine saw it: (sent token_ids, sampled token_ids, their
    logprobs), read from the raw bodies."""
    spans = []
    for exchange in proxy.generates():
        if exchange.status != 200:
            continue
        choice = exchange.response_json()["choices"][0]
        logprobs = [float(c["logprob"]) for c in (choice["logprobs"] or {}).get("content") or []]
        spans.append((exchange.request_json()["token_ids"], choice["token_ids"], logprobs))
    return spans


def assert_records_are_the_engines(records: Any, proxy: RecordingProxy) -> None:
    """Every record is exactly what the engine was sent and sampled: its prompt ids are one
    request's token_ids; every call whose token_ids the record's tokens start with sampled, right
    after them, exactly the engine's token_ids with the engine's logprobs (as float32 in the
    proto), mask 1 there; mask 0 everywhere else. Every answered call lies in some record."""
    import numpy as np

    spans = sampled_spans(proxy)
    assert spans, "the engine answered no generate"
    covered = set()
    for record in records:
        prompt, response = list(record.prompt_ids), list(record.response_ids)
        tokens = prompt + response
        assert any(sent == prompt for sent, _, _ in spans), "a record's prompt was never sent"
        mask = [0] * len(response)
        for index, (sent, sampled, logprobs) in enumerate(spans):
            if tokens[: len(sent)] != sent or len(sent) < len(prompt):
                continue
            start = len(sent) - len(prompt)
            if response[start : start + len(sampled)] != sampled:
                continue
            covered.add(index)
            for i in range(start, start + len(sampled)):
                mask[i] = 1
            got = np.asarray(record.logprobs[start : start + len(sampled)], dtype=np.float32)
            assert np.array_equal(got, np.asarray(logprobs, dtype=np.float32)), "logprobs"
        assert list(record.loss_mask) == mask, "mask 1 only on the engine's sampled ids"
        unmasked = [lp for lp, m in zip(record.logprobs, mask, strict=True) if not m]
        assert all(lp == 0.0 for lp in unmasked)
    assert covered == set(range(len(spans))), "an answered call is in no record"
