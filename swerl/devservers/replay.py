"""A replay policy server: a real HTTP server speaking SGLang's native `/generate`.

It tokenizes with a real tokenizer (the bundled Qwen3 one by default) and answers each request
with the next assistant turn of a script, as token ids with logprobs, the way SGLang does:
`meta_info.output_token_logprobs = [[logprob, id, null], ...]`, `finish_reason.type`,
`weight_version`. Upstream (sglang 0.5.23, `python/sglang/srt/`; tests/agent/
test_replay_upstream.py fails when these lines change): the route `entrypoints/http_server.py:929`
answers `orjson_response(ret)` (:987) or, on a ValueError, `_create_error_response` (:2246-2250:
HTTP 400 `{"error": {"message": ...}}`); `managers/tokenizer_manager.py:2507-2513` builds
`meta_info` with `finish_reason` and `weight_version`, :2869 sets `output_token_logprobs`, whose
triples `detokenize_logprob_tokens` makes (:3098-3108, `(logprob, token_id, None)` when the
text is not asked for). The script is chosen by finding a registered key (e.g. the first line of a
problem statement) in the decoded prompt; the turn is the number of assistant turns in the prompt
(plus those the agent reports omitted). Unknown prompts, and every prompt in garbage mode, get
random tokens. Used by the tests, the benchmark and `swerl demo`; `swerl replay serve` runs it.

Like SGLang it answers the replay extras when a request asks: the kept top-p token set of each
generated token (`sampling_params.custom_params.return_top_p_token_ids`, `replay_top_p`) and
the routed experts of every token of the sequence but the last (`return_routed_experts`,
`replay_experts`), both base64 int32 as in meta_info. It records each request's headers and the
script it matched (`stats.calls`), so tests can check the routing key of every call.

With `fault_control` it also serves `POST /fault {"mode": "error"|"hang"|"none", "duration_s"}`:
for that window every /generate answers HTTP 500, or holds the request until the window ends
(what an overloaded or wedged SGLang does), so a soak can inject policy faults from outside.

    server = ReplayPolicyServer(scripts=scripts_for_tasks(load_tasks(dir)))
    url = await server.start()          # http://127.0.0.1:<port>
    ...
    await server.stop()
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import re
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from swerl.agent.config import SUBMIT_SENTINEL
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir, load_tokenizer
from swerl.chassis.site import serve_app

_OMITTED = re.compile(r"\[(\d+) earlier turns? omitted")
ASSISTANT_HEADER = "<|im_start|>assistant"
WEIGHT_VERSION = "replay-1"


# Policy faults `/fault` may inject, and the longest window one may last (every hang is bounded).
FAULT_MODES = ("error", "hang", "none")
MAX_FAULT_S = 300.0


# Values per token in the replay server's routed experts (e.g. 2 layers x top-2).
REPLAY_EXPERTS_PER_TOKEN = 4


def replay_logprob(position: int) -> float:
    """The logprob the replay server reports for the token at `position` of a response."""
    return -0.001 * (position % 97) - 0.01


def replay_top_p(position: int, token: int) -> list[int]:
    """The kept top-p set the replay server reports for `token` at `position` of a response:
    the token itself and 0 to 2 neighbours."""
    return [token + k for k in range(1 + position % 3)]


def replay_experts(token: int) -> list[int]:
    """The experts the replay server reports for a token of the sequence."""
    return [(token + k) % 64 for k in range(REPLAY_EXPERTS_PER_TOKEN)]


def _b64_int32(values: Iterable[int]) -> str:
    data = array("i", values)
    if sys.byteorder != "little":
        data.byteswap()
    return base64.b64encode(data.tobytes()).decode("ascii")


def _bash(text: str, command: str) -> str:
    return f"{text}\n\n```bash\n{command}\n```"


def submit_turn() -> str:
    return _bash(
        "The change is in place. Submitting.",
        f"echo {SUBMIT_SENTINEL} && git add -A && git diff --cached --binary",
    )


def patch_turn(patch: str, why: str) -> str:
    encoded = base64.b64encode(patch.encode()).decode()
    return _bash(
        why,
        f"echo {encoded} | base64 -d > /tmp/swerl_fix.patch"
        " && git apply /tmp/swerl_fix.patch && git diff --stat",
    )


def gold_script(patch: str) -> list[str]:
    """Look around, apply the fix, run the tests, submit."""
    return [
        _bash("Let me look at the repository first.", "git status --short && ls"),
        patch_turn(patch, "I found the bug; applying the fix."),
        _bash("Now run the test suite.", "python3 -m pytest -q 2>&1 | tail -n 5"),
        submit_turn(),
    ]


def wrong_script(wrong_patch: str | None) -> list[str]:
    """A fix that does not fix: the task's known-wrong patch, or an unrelated edit."""
    if wrong_patch:
        change = patch_turn(wrong_patch, "I think this is the fix.")
    else:
        change = _bash(
            "I think a note in the README is what is needed.",
            "echo '# see the issue tracker' >> README.md && git diff --stat",
        )
    return [_bash("Looking around.", "ls"), change, submit_turn()]


def destructive_script() -> list[str]:
    """Commands a policy does emit while it explores: kill every process of the sandbox (its
    own shell included), look again (the sandbox was started again, files kept), submit."""
    return [
        _bash("Let me note where I am.", "pwd > /tmp/where && ls"),
        _bash("Something is stuck; killing everything.", "kill -9 -1"),
        _bash("Did that help?", "cat /tmp/where && ls"),
        submit_turn(),
    ]


# -- the tool_calls protocol: the same scripts as native tool calls ---------------------------


def _calls(text: str, *calls: tuple[str, dict[str, Any]], parser: str = "qwen25") -> str:
    """A reply: the text, then each call the way the model writes it in `parser`'s format."""
    from swerl.agent.actions.toolcalls import get_tool_call_format

    fmt = get_tool_call_format(parser)
    return text + "".join("\n" + fmt.render_call(name, args) for name, args in calls)


def _tool_patch(patch: str) -> tuple[str, dict[str, Any]]:
    return (
        "str_replace_editor",
        {"command": "create", "path": "/tmp/swerl_fix.patch", "file_text": patch},
    )


def gold_tool_script(patch: str, workdir: str = "/testbed", parser: str = "qwen25") -> list[str]:
    """The gold script with tool calls: two calls in the first reply, the patch written with
    the editor (exact bytes), applied with bash, the tests, then `submit`."""
    return [
        _calls(
            "Let me look at the repository first.",
            ("bash", {"command": "git status --short && ls"}),
            ("str_replace_editor", {"command": "view", "path": workdir}),
            parser=parser,
        ),
        _calls(
            "I found the bug; writing the fix as a patch and applying it.",
            _tool_patch(patch),
            ("bash", {"command": "git apply /tmp/swerl_fix.patch && git diff --stat"}),
            parser=parser,
        ),
        _calls(
            "Now run the test suite.",
            ("bash", {"command": "python3 -m pytest -q 2>&1 | tail -n 5", "timeout": 120}),
            parser=parser,
        ),
        _calls("The change is in place. Submitting.", ("submit", {}), parser=parser),
    ]


def wrong_tool_script(wrong_patch: str | None, parser: str = "qwen25") -> list[str]:
    """A fix that does not fix, with tool calls."""
    if wrong_patch:
        change = _calls(
            "I think this is the fix.",
            _tool_patch(wrong_patch),
            ("bash", {"command": "git apply /tmp/swerl_fix.patch && git diff --stat"}),
            parser=parser,
        )
    else:
        change = _calls(
            "I think a note in the README is what is needed.",
            ("bash", {"command": "echo '# see the issue tracker' >> README.md"}),
            parser=parser,
        )
    return [
        _calls("Looking around.", ("bash", {"command": "ls"}), parser=parser),
        change,
        _calls("Submitting.", ("submit", {}), parser=parser),
    ]


# -- harnesses: each harness's own tools ----------------------------------------------------------


def _mini_bash(text: str, command: str) -> str:
    """A reply of mini-swe-agent's tool-calling model: text, then one call of its `bash` tool
    (Qwen3's Hermes-style format, the harness session's default parser)."""
    return _calls(text, ("bash", {"command": command}))


def _mini_submit() -> list[str]:
    """mini-swe-agent's SWE-bench submission: the patch file, then the exact submit command."""
    return [
        _mini_bash(
            "Writing the patch file (new and binary files included).",
            "git add -A && git diff --cached --binary > patch.txt && wc -l patch.txt",
        ),
        _mini_bash("Submitting.", f"echo {SUBMIT_SENTINEL} && cat patch.txt"),
    ]


def mini_swe_agent_script(patch: str) -> list[str]:
    """The gold script through mini-swe-agent's one tool: look, apply the fix, test, submit."""
    encoded = base64.b64encode(patch.encode()).decode()
    return [
        _mini_bash("Let me look at the repository first.", "git status --short && ls"),
        _mini_bash(
            "I found the bug; applying the fix.",
            f"echo {encoded} | base64 -d > /tmp/swerl_fix.patch"
            " && git apply /tmp/swerl_fix.patch && git diff --stat",
        ),
        _mini_bash("Now run the test suite.", "python3 -m pytest -q 2>&1 | tail -n 5"),
        *_mini_submit(),
    ]


def mini_swe_agent_wrong_script(wrong_patch: str | None) -> list[str]:
    """A fix that does not fix, through mini-swe-agent's one tool."""
    if wrong_patch:
        encoded = base64.b64encode(wrong_patch.encode()).decode()
        change = f"echo {encoded} | base64 -d | git apply && git diff --stat"
    else:
        change = "echo '# see the issue tracker' >> README.md && git diff --stat"
    return [
        _mini_bash("Looking around.", "ls"),
        _mini_bash("I think this is the fix.", change),
        *_mini_submit(),
    ]


# claude-code: its own `Bash` and `Write` tools (the gateway's Anthropic face answers each call
# as a `tool_use` block); a reply without a call ends the CLI's run, and the diff is graded.
CLAUDE_CODE_PATCH = "/tmp/swerl_fix.patch"  # outside the repository: the diff is the fix alone


def _claude_bash(text: str, command: str, description: str) -> str:
    return _calls(text, ("Bash", {"command": command, "description": description}))


def _claude_apply(patch: str, why: str) -> list[str]:
    return [
        _calls(why, ("Write", {"file_path": CLAUDE_CODE_PATCH, "content": patch})),
        _claude_bash(
            "Applying it.", f"git apply {CLAUDE_CODE_PATCH} && git diff --stat", "Apply the patch"
        ),
    ]


def claude_code_script(patch: str) -> list[str]:
    """The gold script through claude-code's tools: look, write the fix with Write, apply it
    with Bash, run the tests, stop."""
    return [
        _claude_bash("Let me look at the repository first.", "git status --short && ls", "Look"),
        *_claude_apply(patch, "I found the bug; writing the fix as a patch."),
        _claude_bash("Now run the test suite.", "python3 -m pytest -q 2>&1 | tail -n 5", "Test"),
        "The fix is in place and the tests pass.",
    ]


def claude_code_wrong_script(wrong_patch: str | None) -> list[str]:
    """A change that does not fix, through claude-code's tools."""
    if wrong_patch:
        change = _claude_apply(wrong_patch, "I think this is the fix.")
    else:
        change = [
            _claude_bash(
                "I think a note in the README is what is needed.",
                "echo '# see the issue tracker' >> README.md && git diff --stat",
                "Edit the README",
            )
        ]
    return [_claude_bash("Looking around.", "ls", "List files"), *change, "Done."]


# Harnesses whose replay scripts are their own (EpisodeOptions.harness -> gold, wrong).
HARNESS_SCRIPTS = {
    "mini-swe-agent": (mini_swe_agent_script, mini_swe_agent_wrong_script),
    "claude-code": (claude_code_script, claude_code_wrong_script),
}


def script_key(problem_statement: str) -> str:
    """How a script finds its prompt: the problem statement's first non-empty line."""
    for line in problem_statement.splitlines():
        if line.strip():
            return line.strip()
    return problem_statement.strip()


def scripts_for_tasks(
    tasks: Iterable[Any], variant: str = "gold", *, tool_call_parser: str = "", harness: str = ""
) -> dict[str, list[str]]:
    """Scripts for `swerl.tasks.TaskInstance`s: `gold` resolves them, `wrong` does not,
    `destructive` kills every process of its sandbox and submits nothing. With a
    `tool_call_parser` (the `tool_calls` protocol) gold and wrong act through tool calls
    written in that parser's format; with a `harness` of HARNESS_SCRIPTS, through that
    harness's own tools."""
    scripts = {}
    own = HARNESS_SCRIPTS.get(harness)
    for task in tasks:
        key = script_key(task.instance["problem_statement"])
        if own is not None and variant in ("gold", "wrong"):
            gold, wrong = own
            scripts[key] = gold(task.gold_patch) if variant == "gold" else wrong(task.wrong_patch)
        elif tool_call_parser and variant == "gold":
            scripts[key] = gold_tool_script(task.gold_patch, parser=tool_call_parser)
        elif tool_call_parser and variant == "wrong":
            scripts[key] = wrong_tool_script(task.wrong_patch, parser=tool_call_parser)
        elif variant == "gold":
            scripts[key] = gold_script(task.gold_patch)
        elif variant == "wrong":
            scripts[key] = wrong_script(task.wrong_patch)
        elif variant == "destructive":
            scripts[key] = destructive_script()
        else:
            raise ValueError(f"unknown script variant {variant!r}")
    return scripts


def script_turn(scripts: Mapping[str, Sequence[str]], prompt: str) -> tuple[str | None, int]:
    """The script a decoded prompt belongs to (its key; None: no key is in the prompt) and the
    turn it asks for: the assistant turns in the prompt, plus those the agent reports omitted."""
    turn = prompt.count(ASSISTANT_HEADER) - 1
    turn += sum(int(n) for n in _OMITTED.findall(prompt))
    key = next((k for k in scripts if k in prompt), None)
    return key, turn


@dataclass(frozen=True)
class ReplayCall:
    """One /generate request: its HTTP headers, the script key it matched (None: none) and
    its sampling_seed (None: none sent), so tests can check a branch's seed reached the policy,
    and the LoRA adapter it named (`lora_path`; None: the base model)."""

    headers: dict[str, str]
    script_key: str | None
    sampling_seed: int | None = None
    lora_path: str | None = None
    # SGLang's `rid` and `extra_key` as sent (None: not sent).
    rid: str | None = None
    extra_key: str | None = None


@dataclass
class ReplayStats:
    requests: int = 0
    garbage: int = 0
    prompt_tokens: list[int] = field(default_factory=list)
    # With keep_requests: every request's input_ids and the ids answered, in arrival order.
    requests_seen: list[tuple[list[int], list[int]]] = field(default_factory=list)
    # Every request's headers and script key, in arrival order.
    calls: list[ReplayCall] = field(default_factory=list)


class ReplayPolicyServer:
    def __init__(
        self,
        scripts: Mapping[str, Sequence[str]] | None = None,
        *,
        tokenizer_dir: str | Path | None = None,
        garbage: bool = False,
        latency_s: float = 0.0,
        abort_on_turn: int | None = None,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        threads: int = 4,
        keep_requests: bool = False,
        fault_control: bool = False,
        context_length: int = 0,
        max_req_input_len: int = 0,
    ) -> None:
        self.tokenizer = load_tokenizer(tokenizer_dir or bundled_qwen3_tokenizer_dir())
        self.scripts = {k: list(v) for k, v in (scripts or {}).items()}
        self.garbage = garbage
        self.latency_s = latency_s
        self.abort_on_turn = abort_on_turn
        self.seed = seed
        self.host = host
        self.port = port
        self.stats = ReplayStats()
        self.keep_requests = keep_requests
        self.end_of_turn = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="replay")
        self._encoded: dict[str, list[int]] = {}
        self._prefix_cache = PrefixCacheModel()
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.fault_control = fault_control
        # The engine's context length (0: unlimited): a longer request is refused with HTTP 400
        # as SGLang's tokenizer manager does (`_validate_one_request`).
        self.context_length = context_length
        # The scheduler's own bound (0: none): SGLang's `max_req_input_len`, the smaller of the
        # context length and the KV pool's size, less one. A KV pool smaller than the context
        # refuses a prompt the tokenizer manager let through.
        self.max_req_input_len = max_req_input_len
        # The injected fault ("error" or "hang") and the monotonic time its window ends.
        self._fault = ("none", 0.0)

    async def start(self) -> str:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        if self.fault_control:
            app.router.add_post("/fault", self._set_fault)
        self._runner, self.port = await serve_app(app, self.host, self.port)
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._pool.shutdown(wait=False)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def inject_fault(self, mode: str, duration_s: float) -> None:
        """For the next `duration_s` seconds every /generate fails as `mode` says ("none" ends
        a window early)."""
        if mode not in FAULT_MODES:
            raise ValueError(f"unknown fault mode {mode!r}; one of {FAULT_MODES}")
        if not 0 <= duration_s <= MAX_FAULT_S:
            raise ValueError(f"duration_s must lie in [0, {MAX_FAULT_S:g}]")
        self._fault = (mode, time.monotonic() + duration_s)

    def _active_fault(self) -> tuple[str, float]:
        mode, until = self._fault
        return (mode, until) if mode != "none" and time.monotonic() < until else ("none", 0.0)

    async def _set_fault(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            self.inject_fault(str(body["mode"]), float(body.get("duration_s", 0.0)))
        except (ValueError, KeyError, TypeError) as err:
            return web.Response(status=400, text=f"bad fault request: {err}")
        return web.Response(text="ok")

    async def _generate(self, request: web.Request) -> web.Response:
        raw = await request.read()
        mode, until = self._active_fault()
        if mode == "error":
            return web.Response(status=500, text="replay: injected policy fault")
        if mode == "hang":
            # Held until the window ends (bounded by MAX_FAULT_S), then answered as usual: a
            # caller with a shorter request timeout has given up by then.
            await asyncio.sleep(max(0.0, until - time.monotonic()))
        refused = self._over_context_length(raw)
        if refused:
            return web.json_response({"error": {"message": refused}}, status=400)
        loop = asyncio.get_running_loop()
        headers = dict(request.headers)
        reply = await loop.run_in_executor(self._pool, self._answer, raw, headers)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        return web.Response(body=reply, content_type="application/json")

    def _answer(self, raw: bytes, headers: dict[str, str] | None = None) -> bytes:
        body = json.loads(raw)
        input_ids = [int(x) for x in body["input_ids"]]
        params = body.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens") or 1024)
        self.stats.requests += 1
        self.stats.prompt_tokens.append(len(input_ids))
        text = self.tokenizer.decode(input_ids, skip_special_tokens=False)
        key, turn = script_turn({} if self.garbage else self.scripts, text)
        seed = params.get("sampling_seed")
        self.stats.calls.append(
            ReplayCall(
                headers or {},
                key,
                None if seed is None else int(seed),
                body.get("lora_path"),
                body.get("rid"),
                body.get("extra_key"),
            )
        )
        script = None if key is None else self.scripts[key]
        finish = "stop"
        if self.abort_on_turn is not None and turn >= self.abort_on_turn:
            ids, finish = [], "abort"
        elif script is None:
            self.stats.garbage += 1
            rng = random.Random(hash((self.seed, len(input_ids), tuple(input_ids[-16:]))))
            ids = [rng.randrange(0, 151_000) for _ in range(rng.randrange(4, 40))]
            ids.append(self.end_of_turn)
        else:
            reply = script[min(turn, len(script) - 1)]
            if reply not in self._encoded:
                self._encoded[reply] = self.tokenizer.encode(reply, add_special_tokens=False)
            ids = [*self._encoded[reply], self.end_of_turn]
        if len(ids) > max_new:
            ids, finish = ids[:max_new], "length"
        if self.keep_requests:
            self.stats.requests_seen.append((input_ids, list(ids)))
        meta = {
            "output_token_logprobs": [[replay_logprob(i), t, None] for i, t in enumerate(ids)],
            "finish_reason": {"type": finish},
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": self._prefix_cache.serve(input_ids, ids),
            "weight_version": WEIGHT_VERSION,
        }
        custom = params.get("custom_params") or {}
        if finish != "abort" and custom.get("return_top_p_token_ids"):
            sets = [replay_top_p(i, t) for i, t in enumerate(ids)]
            offsets = [0]
            for kept in sets:
                offsets.append(offsets[-1] + len(kept))
            meta["top_p_token_ids"] = _b64_int32(t for kept in sets for t in kept)
            meta["top_p_token_offsets"] = _b64_int32(offsets)
        if finish != "abort" and body.get("return_routed_experts"):
            sequence = [*input_ids, *ids][:-1]
            meta["routed_experts"] = _b64_int32(e for t in sequence for e in replay_experts(t))
            meta["routed_experts_start_len"] = 0
        out = {"text": self.tokenizer.decode(ids, skip_special_tokens=True), "meta_info": meta}
        return json.dumps(out).encode()

    def _over_context_length(self, raw: bytes) -> str:
        """SGLang's refusal of a request over the context length ("" when it fits): the input
        alone reaching it, or input + max_new_tokens exceeding it, in SGLang's words (sglang
        0.5.23 `managers/tokenizer_manager.py:1307` `_validate_one_request`, messages at
        :1349-1350 and :1372-1376; no reserved tokens here)."""
        if not self.context_length and not self.max_req_input_len:
            return ""
        body = json.loads(raw)
        n = len(body.get("input_ids") or [])
        max_new = int((body.get("sampling_params") or {}).get("max_new_tokens") or 0)
        if not self.context_length:
            return self._over_scheduler_limit(n)
        if n >= self.context_length:
            return (
                f"The input ({n} tokens) is longer than the model's context length"
                f" ({self.context_length} tokens)."
            )
        if n + max_new > self.context_length:
            return (
                "Requested token count exceeds the model's maximum context length of"
                f" {self.context_length} tokens. You requested a total of {n + max_new} tokens:"
                f" {n} tokens from the input messages and {max_new} tokens for the completion."
                " Please reduce the number of tokens in the input messages or the completion to"
                " fit within the limit."
            )
        return self._over_scheduler_limit(n)

    def _over_scheduler_limit(self, n: int) -> str:
        """The scheduler's refusal of a prompt the tokenizer manager passed ("" when it fits):
        sglang 0.5.23 `managers/utils.py:259` `validate_input_length` (message at :282-286),
        called by `Scheduler.handle_generate_request` (`managers/scheduler.py:3246-3252`), which
        aborts the request with 400 (`schedule_batch.py:2221-2225`); the tokenizer manager raises
        it as ValueError (`tokenizer_manager.py:1917-1918`) and `/generate` answers 400 with
        `{"error": {"message": ...}}`. Without --allow-auto-truncate."""
        limit = self.max_req_input_len
        if not limit or n < limit:
            return ""
        return (
            f"Input length ({n} tokens) exceeds the maximum allowed length ({limit} tokens)."
            " Use a shorter input or enable --allow-auto-truncate."
        )


class PrefixCacheModel:
    """An engine's prefix cache as `meta_info.cached_tokens` reports it: the longest prefix of
    a prompt that an earlier call's prompt + output shared (SGLang's radix cache keeps both).
    A few recent sequences are kept per opening (the first 16 tokens); the last prompt token is
    always computed. Thread-safe (the replay server answers in a pool)."""

    KEPT_PER_OPENING = 8
    OPENING = 16

    def __init__(self) -> None:
        self._seen: dict[tuple[int, ...], deque[list[int]]] = {}
        self._lock = threading.Lock()

    def serve(self, input_ids: list[int], output_ids: Sequence[int]) -> int:
        """The cached tokens of this call; then remembers its prompt + output."""
        key = tuple(input_ids[: self.OPENING])
        with self._lock:
            earlier = self._seen.setdefault(key, deque(maxlen=self.KEPT_PER_OPENING))
            cached = max((common_prefix(input_ids, s) for s in earlier), default=0)
            earlier.append([*input_ids, *output_ids])
        return min(cached, max(len(input_ids) - 1, 0))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of a and b (bisection over slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
