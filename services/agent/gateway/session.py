"""Gateway sessions: open, look up, call, close; one call's whole flow.

A call: find the recorded call its history continues (by message digests, else by token
prefix), render only what follows it (or the whole conversation for a new root) in the CPU pool,
check the context budget, send the exact ids to the policy, parse reasoning and tool calls, and
record the call in the session's tree. Rendering, decoding and parsing, and building
CloseSession's records, go to the executor: even a turn's worth of them on the loop, times a few
hundred sessions answered in the same instant, stalls it (measured), while in the pool the loop
takes the GIL back every switch interval. Domain code: no HTTP, no grpc.
"""

from __future__ import annotations

import asyncio
import enum
import secrets
import time
import uuid
from array import array
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jinja2

from swerl.agent.errors import TokenizerUnavailable
from swerl.agent.gateway.errors import (
    BadSecret,
    ContextTooLong,
    EngineRefusedContext,
    GatewayAtCapacity,
    InvalidSessionSpec,
    PolicyDown,
    SessionAborted,
    SessionClosed,
    SessionMissing,
    SessionNotFound,
)
from swerl.agent.gateway.messages import (
    Conversation,
    ConversationReader,
    ToolCall,
    assistant_message,
    chain_digests,
    message_key,
    roll,
)
from swerl.agent.gateway.parsing import OutputParser, ParsedOutput, output_parser
from swerl.agent.gateway.render import OverBudget, Renderer
from swerl.agent.gateway.tree import CallKind, CallNode, CallTree, chain_records
from swerl.agent.loop.pacing import IterationGate
from swerl.agent.policy.clients import Generation, PolicyUnavailable, TokenPolicy
from swerl.agent.policy.context import ContextExhausted
from swerl.agent.policy.tokens import ChatCodec, TokenRecordData
from swerl.agent.policy.vllm import UnsupportedSamplingParam, vllm_sampling_params

T = TypeVar("T")
DEFAULT_MAX_NEW_TOKENS = 4096
# apply_chat_template's own parameters that the gateway sets itself or that change what it
# returns: as template kwargs they would collide with the gateway's call or break its rendering.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
DEFAULT_MODEL = "swerl-policy"
# The engines a session's policy calls go to (SessionSpec.engine): their token APIs.
ENGINE_SGLANG = "sglang"
ENGINE_VLLM = "vllm"


class SessionState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"
    LIMIT_CONTEXT = "limit_context"
    ABORTED = "aborted"


@dataclass(frozen=True)
class SessionSpec:
    """What OpenSession fixes for the session's lifetime."""

    endpoint: str
    tokenizer_path: str
    model: str = DEFAULT_MODEL
    sampling_params: Mapping[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 0.0
    max_context_tokens: int = 0
    max_new_tokens: int = 0
    lora_path: str = ""
    # PolicyConfig.request_id_prefix / cache_key (SGLang's `rid` prefix and `extra_key`).
    request_id_prefix: str = ""
    cache_key: str = ""
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    owner: str = ""
    # Where CloseSession writes the session for `swerl inspect` (empty: nowhere).
    artifact_dir: str = ""
    # Whose token API the endpoint serves: SGLang's /generate or vLLM's /inference/v1/generate.
    engine: str = ENGINE_SGLANG

    def check(self) -> None:
        if not self.endpoint:
            raise InvalidSessionSpec("policy.endpoint is required", field="policy.endpoint")
        if not self.tokenizer_path:
            raise InvalidSessionSpec(
                "policy.tokenizer_path is required (the gateway renders with its chat template)",
                field="policy.tokenizer_path",
            )
        if self.max_context_tokens < 0 or self.max_new_tokens < 0:
            raise InvalidSessionSpec("limits must not be negative", field="max_context_tokens")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(self.template_kwargs))
        if reserved:
            raise InvalidSessionSpec(
                f"template_kwargs may not set {', '.join(reserved)}: the gateway's rendering"
                " sets them itself",
                field="template_kwargs",
            )
        if self.artifact_dir and not self.artifact_dir.startswith("/"):
            raise InvalidSessionSpec(
                "artifact_dir must be an absolute path on the agent's host", field="artifact_dir"
            )
        if self.engine not in (ENGINE_SGLANG, ENGINE_VLLM):
            raise InvalidSessionSpec(f"no engine {self.engine!r}", field="policy.api")
        if self.engine == ENGINE_VLLM:
            try:  # vLLM would ignore an unknown key: refused when the session opens
                vllm_sampling_params(self.sampling_params)
            except UnsupportedSamplingParam as err:
                raise InvalidSessionSpec(
                    err.message, field=f"policy.sampling_params.{err.key}"
                ) from None

    def max_new(self) -> int:
        if self.max_new_tokens:
            return self.max_new_tokens
        value = self.sampling_params.get("max_new_tokens")
        return (
            int(value) if isinstance(value, int | float) and value > 0 else DEFAULT_MAX_NEW_TOKENS
        )


# Builds the policy client of one branch of a session (the spec's engine's token API).
PolicyFactory = Callable[[SessionSpec, str], TokenPolicy]
# Loads (once) the chat codec of a tokenizer path and template kwargs.
CodecSource = Callable[[str, dict[str, Any]], Awaitable[ChatCodec]]


@dataclass
class CallAnswer:
    """What a protocol face needs to answer one call."""

    content: str
    reasoning: str | None
    tool_calls: list[ToolCall]
    finish_reason: str  # stop | length
    prompt_tokens: int
    completion_tokens: int
    model: str
    # Seconds spent waiting for the policy (the rest of a call is the gateway's overhead).
    policy_s: float = 0.0


@dataclass
class SessionCounters:
    infra_errors: int = 0
    context_errors: int = 0
    in_flight: int = 0
    # Seconds over the answered calls: waiting for the policy, and everything else.
    policy_time_s: float = 0.0
    overhead_time_s: float = 0.0

    def metrics(self, tree: CallTree) -> dict[str, float]:
        """The session's figures, named like the agent's episode metrics (`agent/*` in the
        trainer's logs once a harness episode reports them)."""
        calls = tree.calls
        return {
            "gateway_calls": float(len(calls)),
            "gateway_roots": float(sum(1 for c in calls if c.kind is CallKind.ROOT)),
            "gateway_forks": float(sum(1 for c in calls if c.kind is CallKind.FORK)),
            "gateway_chains": float(sum(1 for _ in tree.leaves())),
            "tool_calls": float(sum(c.tool_calls for c in calls)),
            "gateway_sampled_tokens": float(sum(len(c.output_ids) for c in calls)),
            "gateway_reused_tokens": float(sum(c.reused_tokens for c in calls)),
            "model_query_time_sum": self.policy_time_s,
            "gateway_overhead_time_sum": self.overhead_time_s,
            "gateway_infra_errors": float(self.infra_errors),
            "gateway_context_errors": float(self.context_errors),
        }


class Session:
    def __init__(
        self,
        session_id: str,
        secret: str,
        spec: SessionSpec,
        renderer: Renderer,
        parser: OutputParser,
    ) -> None:
        self.id = session_id
        self.secret = secret
        self.spec = spec
        self.renderer = renderer
        self.parser = parser
        self.tree = CallTree()
        self.state = SessionState.OPEN
        self.counters = SessionCounters()
        self.aborted = asyncio.Event()
        # Set when the session cannot go on: its policy is down (`policy_failure`, after the
        # policy client's retries) or the trainer aborted it (a harness episode ends at once).
        self.failed = asyncio.Event()
        self.policy_failure: PolicyUnavailable | None = None
        self.opened = time.time()
        # Policy clients of the branch tips: a client keeps its last request's serialized ids,
        # so a chain's calls serialize only their new ids. Taken by a call, put back under the
        # node it recorded.
        self.policies: dict[int, TokenPolicy] = {}
        # Per protocol: the reader that decodes only what a re-sent history adds (http.py).
        self.readers: dict[str, ConversationReader] = {}
        self.close_request_id = ""
        # Closed, whatever state it ended in; its records once built (off the loop by aclose).
        self.ended = False
        self.records: list[TokenRecordData] | None = None
        self.closing: asyncio.Future[list[TokenRecordData]] | None = None


# Gateway steps per event-loop iteration: reading a request and matching it to the tree, sending
# its policy request, recording the answer and writing the reply (~0.06-0.1 ms of the loop's CPU
# each on the development machine). 200 sessions x 6 turns on 2 cores, worst loop stall: 34-47
# ms without the gate; with it (three runs each) 8 per iteration 15-24 ms, 4: 12-20 ms, 2: 15-16
# ms, calls/s unchanged (~150). Two per iteration still lets thousands of steps through a second.
GATEWAY_TURNS = 2

# A call whose CPU work is over this size (its body's bytes to decode, its messages' characters
# to render) does that work in the store's own one-thread lane, not in the CPU pool all the
# other sessions' calls share: 4 MiB is more than any context a policy serves (~1M tokens of
# text), so only such bodies queue there, behind each other, and a small call never waits for
# one (its decode, render and tokenizing are bounded by the body maximum and the budget).
LARGE_WORK_BYTES = 4 * 1024 * 1024

# A call whose CPU work is at most this size (characters to render and tokenize, sampled ids to
# decode and parse) does it on the event loop, inline: a hop to the CPU pool and back costs
# more than the work (~0.12 ms a round trip on the development machine, two per call, against
# ~0.2 ms to render and tokenize 2,000 characters of tool output), and such work is shorter
# than the loop's stall target by far. Larger work goes to the pool, as before.
INLINE_WORK_SIZE = 4096


class SessionStore:
    """The sessions of one agent process."""

    def __init__(
        self,
        *,
        codecs: CodecSource,
        policy_factory: PolicyFactory,
        executor: Executor | None,
        max_sessions: int = 4096,
        keep_ended: int = 256,
    ) -> None:
        self._codecs = codecs
        # The calls' steps that run on the event loop between two awaits (see GATEWAY_TURNS)
        # take their turn here: hundreds of sessions moving in step would otherwise run them
        # back to back in one loop iteration.
        self.turns = IterationGate(GATEWAY_TURNS)
        self._policy_factory = policy_factory
        self._executor = executor
        self._large = ThreadPoolExecutor(1, thread_name_prefix="gateway-large")
        self._max_sessions = max_sessions
        self._keep_ended = keep_ended
        self.sessions: dict[str, Session] = {}
        self._by_request: dict[str, str] = {}
        self._ended_order: list[str] = []

    async def _cpu(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def cpu(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn` inline when its work is `size` <= INLINE_WORK_SIZE, in the CPU pool up to
        LARGE_WORK_BYTES, in the large lane beyond."""
        if size <= INLINE_WORK_SIZE:
            return fn(*args)
        executor = self._large if size > LARGE_WORK_BYTES else self._executor
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    def shutdown(self) -> None:
        self._large.shutdown(wait=False, cancel_futures=True)

    # -- lifecycle (the session RPCs) ----------------------------------------------------------

    async def open(self, spec: SessionSpec, request_id: str = "") -> Session:
        if request_id and request_id in self._by_request:
            return self.sessions[self._by_request[request_id]]
        spec.check()
        open_now = sum(1 for s in self.sessions.values() if not s.ended)
        if open_now >= self._max_sessions:
            raise GatewayAtCapacity(
                f"this agent holds {open_now} open sessions (its limit)", limit=self._max_sessions
            )
        parser = output_parser(spec.tool_call_parser, spec.reasoning_parser)
        try:
            codec = await self._codecs(spec.tokenizer_path, dict(spec.template_kwargs))
        except jinja2.TemplateError as err:
            # A template that does not parse, raises (`raise_exception`), or reads an
            # undefined name: the spec's tokenizer cannot render, in the template's own words.
            where = (
                f" with template_kwargs {dict(spec.template_kwargs)}"
                if spec.template_kwargs
                else ""
            )
            raise TokenizerUnavailable(
                f"the chat template of {spec.tokenizer_path!r} fails{where}:"
                f" {type(err).__name__}: {err}",
                tokenizer_path=spec.tokenizer_path,
            ) from err
        renderer = Renderer(codec)
        if spec.max_context_tokens:
            # The size bound's measure, in the large lane: before any large call, after none.
            self._large.submit(renderer.measure)
        session = Session(uuid.uuid4().hex, secrets.token_urlsafe(24), spec, renderer, parser)
        self.sessions[session.id] = session
        if request_id:
            self._by_request[request_id] = session.id
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"no session {session_id!r}", session_id=session_id)
        return session

    def close(
        self, session_id: str, *, request_id: str = "", abort: bool = False
    ) -> list[TokenRecordData]:
        """End the session and build its records here (tests, benchmarks; the RPC uses aclose)."""
        session = self._end(session_id, request_id, abort)
        if session.records is None:
            session.records = chain_records(session.tree, len(session.tree.calls))
        return session.records

    async def aclose(
        self, session_id: str, *, request_id: str = "", abort: bool = False
    ) -> list[TokenRecordData]:
        """End the session at once (no call is recorded after this) and build its records in
        the CPU pool: a long session's chains are megabytes of ids, not the event loop's work."""
        session = self._end(session_id, request_id, abort)
        if session.records is not None:
            return session.records
        if session.closing is None:
            session.closing = asyncio.ensure_future(
                self._cpu(chain_records, session.tree, len(session.tree.calls))
            )
        records = await asyncio.shield(session.closing)
        session.records = records
        return records

    def _end(self, session_id: str, request_id: str, abort: bool) -> Session:
        session = self.get(session_id)
        if session.ended:
            if request_id and request_id == session.close_request_id:
                return session
            raise SessionClosed(f"session {session_id!r} is closed", session_id=session_id)
        if abort or session.state is SessionState.ABORTED:
            session.state = SessionState.ABORTED
            session.aborted.set()
            session.failed.set()
        elif session.state is SessionState.OPEN:
            session.state = SessionState.CLOSED
        # LIMIT_CONTEXT stays: the episode ended on its context budget.
        session.close_request_id = request_id
        session.ended = True
        session.readers.clear()
        session.policies.clear()
        session.aborted.set()  # any call still in flight is answered with an error
        self._ended_order.append(session_id)
        while len(self._ended_order) > self._keep_ended:
            old = self._ended_order.pop(0)
            gone = self.sessions.pop(old, None)
            if gone is not None and gone.close_request_id:
                self._by_request = {k: v for k, v in self._by_request.items() if v != old}
        return session

    # -- one HTTP call --------------------------------------------------------------------------

    def for_call(self, session_id: str, secret: str | None) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.ended:
            if session is not None and session.state is SessionState.ABORTED:
                raise SessionAborted(f"session {session_id} was aborted by the trainer")
            raise SessionMissing(f"no open session {session_id!r}")
        if not secret or not secrets.compare_digest(secret, session.secret):
            raise BadSecret("invalid session secret (Authorization: Bearer <secret>)")
        if session.state is SessionState.ABORTED:
            raise SessionAborted(f"session {session_id} was aborted by the trainer")
        return session

    async def call(self, session: Session, conv: Conversation, protocol: str) -> CallAnswer:
        counters = session.counters
        counters.in_flight += 1
        started = time.perf_counter()
        try:
            answer = await self._call(session, conv, protocol)
        finally:
            counters.in_flight -= 1
        counters.policy_time_s += answer.policy_s
        counters.overhead_time_s += time.perf_counter() - started - answer.policy_s
        return answer

    def _match(
        self, session: Session, conv: Conversation
    ) -> tuple[CallNode | None, int, list[bytes]]:
        """The recorded call the conversation continues and where its new messages start."""
        digests = conv.digests or chain_digests(conv.tools_key(), conv.keys)
        for i in range(len(conv.messages) - 1, -1, -1):
            if conv.messages[i]["role"] != "assistant":
                continue
            node = session.tree.find(digests[i])
            if node is not None:
                return node, i + 1, digests
        return None, 0, digests

    async def _call(self, session: Session, conv: Conversation, protocol: str) -> CallAnswer:
        renderer, spec = session.renderer, session.spec
        budget = spec.max_context_tokens
        parent, start, digests = self._match(session, conv)
        try:
            if parent is not None:
                ended = bool(parent.output_ids) and parent.output_ids[-1] == renderer.end_of_turn_id
                reused = parent.token_count()
                new = conv.messages[start:]
                limit = max(1, budget - reused) if budget else 0
                delta = await self.cpu(_text_size(new), renderer.delta, new, ended, limit)
                prompt = parent.extended(delta)
            else:
                ids = await self.cpu(
                    conv.body_bytes, renderer.full, conv.messages, conv.tools, budget
                )
                prompt = array("i", ids)
                parent = session.tree.longest_token_prefix(prompt)
                reused = parent.token_count() if parent is not None else 0
        except OverBudget as over:
            # Refused on the render's size, untokenized: `at_least` bounds its ids from below
            # (a delta's first may be the end-of-turn the sampled ids already hold).
            at_least = over.at_least if parent is None else reused + over.at_least - 1
            raise _over_budget(session, at_least, budget, at_least=True) from over
        max_new = min(spec.max_new(), conv.max_tokens or spec.max_new())
        if budget:
            if len(prompt) >= budget:
                raise _over_budget(session, len(prompt), budget)
            max_new = min(max_new, budget - len(prompt))
        policy = session.policies.pop(parent.index, None) if parent is not None else None
        if policy is None:
            policy = self._policy_factory(spec, session.id)
        policy_started = time.perf_counter()
        generation = await self._generate(session, policy, prompt, max_new)
        policy_s = time.perf_counter() - policy_started
        parsed = await self.cpu(
            len(generation.output_ids),
            _read_output,
            session,
            generation.output_ids,
            conv.tools,
            generation.finish_reason,
        )
        await self.turns.wait_turn()
        reply = assistant_message(parsed.content, parsed.reasoning, parsed.tool_calls)
        # The next call that echoes this reply after this history continues this node.
        digest = roll(digests[-1], message_key(reply))
        node = session.tree.add(
            parent,
            protocol=protocol,
            prompt_ids=prompt,
            output_ids=array("i", generation.output_ids),
            logprobs=array("d", generation.logprobs),
            finish_reason=generation.finish_reason,
            weight_version=generation.weight_version,
            reused_tokens=reused,
            tool_calls=len(parsed.tool_calls),
            request_messages=len(conv.messages),
            rendered_messages=len(conv.messages) - start,
            digest=digest,
        )
        if not session.ended:
            session.policies[node.index] = policy
        return CallAnswer(
            content=parsed.content,
            reasoning=parsed.reasoning,
            tool_calls=list(parsed.tool_calls),
            finish_reason=generation.finish_reason,
            prompt_tokens=len(prompt),
            completion_tokens=len(generation.output_ids),
            model=spec.model or DEFAULT_MODEL,
            policy_s=policy_s,
        )

    async def _generate(
        self, session: Session, policy: TokenPolicy, prompt: array[int], max_new: int
    ) -> Generation:
        """The policy call, abandoned when the session is aborted meanwhile."""
        task = asyncio.ensure_future(policy.generate(prompt, max_new))
        aborted = asyncio.ensure_future(session.aborted.wait())
        try:
            await asyncio.wait({task, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
        if not task.done():
            task.cancel()
            if session.state is not SessionState.ABORTED:
                raise SessionMissing(f"session {session.id} was closed during this call")
            raise SessionAborted(f"session {session.id} was aborted by the trainer")
        try:
            generation = task.result()
        except ContextExhausted as err:  # the engine's own context-length refusal
            session.counters.context_errors += 1
            if session.state is SessionState.OPEN:
                session.state = SessionState.LIMIT_CONTEXT
            raise EngineRefusedContext(len(prompt), str(err)) from err
        except PolicyUnavailable as err:
            session.counters.infra_errors += 1
            session.policy_failure = err
            session.failed.set()
            raise PolicyDown(f"the policy is unavailable ({err.reason}): {err.message}") from err
        if generation.finish_reason == "abort":
            session.state = SessionState.ABORTED
            session.aborted.set()
            session.failed.set()
            raise SessionAborted(f"session {session.id}: the trainer aborted the generation")
        return generation


def _text_size(messages: Sequence[Mapping[str, Any]]) -> int:
    """The characters of the messages' text fields (what rendering them costs, roughly)."""
    size = 0
    for message in messages:
        for value in message.values():
            if isinstance(value, str):
                size += len(value)
    return size


def _over_budget(
    session: Session, prompt_tokens: int, budget: int, *, at_least: bool = False
) -> ContextTooLong:
    """The refusal of a prompt over the session's budget; the episode ends on its context."""
    session.counters.context_errors += 1
    if session.state is SessionState.OPEN:
        session.state = SessionState.LIMIT_CONTEXT
    return ContextTooLong(prompt_tokens, budget, at_least=at_least)


def _read_output(
    session: Session,
    output_ids: Sequence[int],
    tools: list[dict[str, Any]] | None,
    finish_reason: str,
) -> ParsedOutput:
    """Decode and parse the sampled ids (one trip to the CPU pool)."""
    text = session.renderer.decode(output_ids)
    return session.parser.parse(text, tools, finish_reason)
