"""The agent's episode runner: validates a start, prepares tokenizer and policy, and streams one
episode's messages while listening for `cancel` (what RunEpisode does, minus the protos' wire)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
from google.protobuf.json_format import MessageToDict

from swerl.agent.config import load_config
from swerl.agent.errors import (
    AgentAtCapacity,
    EpisodeRunning,
    InvalidEpisodeStart,
    StartRequired,
    TokenizerUnavailable,
)
from swerl.agent.gateway.service import Gateway, gateway_cpu_pool
from swerl.agent.harnesses import DEFAULT_HARNESS, harness_named
from swerl.agent.judging.steps import PRM_STEP_TIMEOUT_S, PrmSpec, StepJudge
from swerl.agent.loop.artifacts import write_artifacts
from swerl.agent.loop.episode import Episode, EpisodeDeps
from swerl.agent.loop.pacing import IterationGate
from swerl.agent.loop.sandbox import SandboxProvider
from swerl.agent.policy.clients import OpenAIChatPolicy, SglangPolicy, policy_retrying
from swerl.agent.policy.modes import ChatMode, Policy, TokenMode
from swerl.agent.policy.tokens import ChatCodec, TemplateMismatch, codec_key, worker_call
from swerl.agent.policy.vllm import UnsupportedSamplingParam, VllmPolicy, vllm_sampling_params
from swerl.agent.settings import AgentSettings
from swerl.agent.spec import EpisodeSpec, sampling_params_of
from swerl.agent.v1 import agent_pb2 as pb
from swerl.chassis.gctune import tune_collector
from swerl.chassis.hf import load_tokenizer
from swerl.chassis.timeconv import seconds_of

# Most branches of one episode (EpisodeBranch.count).
MAX_BRANCHES = 64
# The policy APIs that return exact token ids and logprobs (the episode trains on them).
TOKEN_APIS = (pb.POLICY_API_SGLANG_GENERATE, pb.POLICY_API_VLLM_GENERATE)

# Builds the PRM judge of one PRM-enabled episode from its PrmSpec and episode id.
JudgeFactory = Callable[[PrmSpec, str], StepJudge]


def _worker_init() -> None:
    # Tokenizer workers yield the CPU to the event loop that waits for them, and die with it.
    # Nice 10, not 5: with 5 (scheduler weight 335 of a nice-0 task's 1024) the loop thread
    # queued behind a worker for up to ~10 ms on a busy 2-core machine; at 10 (weight 110) a
    # waking loop thread gets the core at once in practice. Not lower: SCHED_IDLE (weight 3)
    # or nice 19 (15) leave the workers, and so every episode's turns, next to no CPU while
    # other normal-priority processes keep the cores busy.
    with contextlib.suppress(OSError):
        os.nice(10 - os.nice(0))
    with contextlib.suppress(Exception):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EpisodeRunner:
    """Runs episodes for one process; shares the CPU pool, HTTP session and tokenizers."""

    def __init__(
        self,
        settings: AgentSettings,
        provider: SandboxProvider,
        *,
        judge_factory: JudgeFactory | None = None,
    ) -> None:
        self.settings = settings
        self.provider = provider
        self.executor = ThreadPoolExecutor(settings.cpu_threads, thread_name_prefix="agent-cpu")
        # The model gateway's own CPU pool (one thread by default), apart from the episodes'.
        self.gateway_executor = gateway_cpu_pool(settings.gateway_cpu_threads)
        self.tokenizer_pool: ProcessPoolExecutor | None = None
        if settings.tokenizer_processes > 0:
            # spawn, not fork: the parent runs gRPC threads, which fork would copy half-alive.
            self.tokenizer_pool = ProcessPoolExecutor(
                settings.tokenizer_processes,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init,
            )
        self._judge_factory = judge_factory
        self._session: aiohttp.ClientSession | None = None
        self._codecs: dict[tuple[str, str], ChatCodec] = {}
        self._codec_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.running: dict[str, Episode] = {}
        # Set-up of new episodes and final results of ending ones: at most 16 per iteration.
        self._start_gate = IterationGate(16)
        self._result_gate = IterationGate(16)
        # Records are built in the CPU pool one episode at a time. Threads running Python
        # hand the GIL to each other (each result's hand-off to the loop is a syscall that
        # releases it), so a backlog of record jobs kept the loop thread from running for
        # 15-20 ms when 50 episodes ended together; GIL-bound, more at once is no faster.
        self._records_slot = asyncio.Semaphore(1)
        self.policy_retrying = policy_retrying(
            settings.policy_connect_attempts, settings.policy_connect_max_delay_s
        )
        # The model gateway harness episodes open their sessions on: the agent's served one
        # (AgentServer sets it), else one on a loopback port started at the first need.
        self.gateway: Gateway | None = None
        self._own_gateway: Gateway | None = None
        self._gateway_lock = asyncio.Lock()

        async def artifacts(episode: Episode, result: pb.EpisodeResult) -> str:
            return await write_artifacts(episode, result, self.executor)

        self._deps = EpisodeDeps(
            provider=provider,
            executor=self.executor,
            write_artifacts=artifacts,
            result_gate=self._result_gate,
            records_slot=self._records_slot,
            gateway=self.harness_gateway,
        )

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.settings.policy_max_connections)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def harness_gateway(self) -> Gateway:
        """The gateway of harness episodes' sessions (see __init__)."""
        async with self._gateway_lock:
            if self.gateway is None:
                gateway = Gateway(
                    http_session=self.session,
                    codecs=self.codec,
                    executor=self.gateway_executor,
                    host="127.0.0.1",
                    port=0,
                    routing_key_header=self.settings.routing_key_header,
                    retrying=self.policy_retrying,
                    request_timeout_s=self.settings.policy_request_timeout_s,
                )
                await gateway.start()
                self.gateway = self._own_gateway = gateway
            return self.gateway

    async def close(self) -> None:
        for episode in list(self.running.values()):
            episode.cancel("agent shutting down")
        if self._own_gateway is not None:
            await self._own_gateway.stop()
        if self._session is not None:
            await self._session.close()
        self.executor.shutdown(wait=False)
        self.gateway_executor.shutdown(wait=False)
        if self.tokenizer_pool is not None:
            self.tokenizer_pool.shutdown(wait=True, cancel_futures=True)

    async def codec(self, tokenizer_path: str, template_kwargs: dict[str, Any]) -> ChatCodec:
        key = codec_key(tokenizer_path, template_kwargs)
        lock = self._codec_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in self._codecs:
                loop = asyncio.get_running_loop()

                def build() -> ChatCodec:
                    return ChatCodec(load_tokenizer(key[0]), template_kwargs, key[0])

                try:
                    codec = await loop.run_in_executor(self.executor, build)
                except (OSError, ValueError, TemplateMismatch) as err:
                    raise TokenizerUnavailable(
                        f"cannot load tokenizer {tokenizer_path!r}: {err}",
                        tokenizer_path=tokenizer_path,
                    ) from err
                if self.tokenizer_pool is not None:
                    # Each worker loads the tokenizer once, before the first episode needs it.
                    warm = [
                        loop.run_in_executor(
                            self.tokenizer_pool, worker_call, key, "encode", "warm"
                        )
                        for _ in range(2 * self.settings.tokenizer_processes)
                    ]
                    await asyncio.gather(*warm)
                self._codecs[key] = codec
                # The tokenizer's hundreds of thousands of long-lived objects leave the cyclic
                # collector's view: a full collection would otherwise stall the loop.
                # Full collections find nothing in an agent's steady state (tests/agent checks
                # that a policy turn leaves no cycle); young ones still catch the rare cycle.
                tune_collector(full_every=self.settings.gc_full_threshold)
        return self._codecs[key]

    def _spec(self, start: pb.EpisodeStart) -> EpisodeSpec:
        if not start.episode_id:
            raise InvalidEpisodeStart("episode_id is required", field="episode_id")
        if not start.instance.image_name:
            raise InvalidEpisodeStart("instance.image_name is required", field="instance")
        if not start.policy.endpoint:
            raise InvalidEpisodeStart("policy.endpoint is required", field="policy.endpoint")
        config = load_config(start.options.config_name)
        api = start.policy.api or pb.POLICY_API_SGLANG_GENERATE
        if api not in pb.PolicyApi.values():
            raise InvalidEpisodeStart(f"policy.api {api} is no PolicyApi", field="policy.api")
        tokens_api = api in TOKEN_APIS
        if tokens_api and not start.policy.tokenizer_path:
            raise InvalidEpisodeStart(
                f"policy.tokenizer_path is required for {pb.PolicyApi.Name(api)[11:]}",
                field="policy",
            )
        if start.policy.return_routed_experts and api != pb.POLICY_API_SGLANG_GENERATE:
            raise InvalidEpisodeStart(
                "policy.return_routed_experts (routing replay) needs SGLANG_GENERATE: a chat"
                " API returns no routed experts",
                field="policy.return_routed_experts",
            )
        for name in ("request_id_prefix", "cache_key"):
            if getattr(start.policy, name) and api != pb.POLICY_API_SGLANG_GENERATE:
                raise InvalidEpisodeStart(
                    f"policy.{name} is SGLang's (`rid` prefix / `extra_key`) and needs"
                    f" SGLANG_GENERATE, not {pb.PolicyApi.Name(api)[11:]}",
                    field=f"policy.{name}",
                )
        opts, limits, d = start.options, start.limits, config.defaults
        if not opts.skip_evaluation and not start.instance.fail_to_pass:
            raise InvalidEpisodeStart(
                "instance.fail_to_pass is required unless options.skip_evaluation",
                field="instance",
            )
        root = self.settings.artifact_root
        if opts.artifact_dir and root is not None:
            resolved = Path(opts.artifact_dir).resolve()
            if not resolved.is_relative_to(Path(root).resolve()):
                raise InvalidEpisodeStart(
                    f"artifact_dir must be below {root}", field="options.artifact_dir"
                )
        for name in ("max_turns", "max_context_tokens", "max_new_tokens"):
            if getattr(limits, name) < 0:
                raise InvalidEpisodeStart(f"limits.{name} is negative", field=f"limits.{name}")
        prm_endpoint = start.prm.endpoint or (self.settings.prm_endpoint or "")
        if start.prm.enabled and not prm_endpoint:
            raise InvalidEpisodeStart(
                "prm.enabled needs prm.endpoint (or the agent's --prm-endpoint)", field="prm"
            )
        max_turns = limits.max_turns or d.max_turns
        branch = opts.branch
        if branch.count or branch.at_turn:
            if not 1 <= branch.count <= MAX_BRANCHES:
                raise InvalidEpisodeStart(
                    f"options.branch.count must be 1 to {MAX_BRANCHES}", field="options.branch"
                )
            if not 0 <= branch.at_turn < max_turns:
                raise InvalidEpisodeStart(
                    f"options.branch.at_turn must be 0 to max_turns - 1 ({max_turns - 1})",
                    field="options.branch",
                )
            if not tokens_api:
                raise InvalidEpisodeStart(
                    "options.branch needs SGLANG_GENERATE or VLLM_GENERATE: branches copy the"
                    " exact token state",
                    field="options.branch",
                )
        harness = opts.harness or DEFAULT_HARNESS
        harness_named(harness)  # an unknown name is refused here (UNKNOWN_HARNESS)
        if harness != DEFAULT_HARNESS and (branch.count or branch.at_turn):
            raise InvalidEpisodeStart(
                "options.branch needs the builtin harness: only swerl's loop can stop at a turn",
                field="options.branch",
            )
        if harness != DEFAULT_HARNESS and not tokens_api:
            raise InvalidEpisodeStart(
                f"harness {harness!r} needs SGLANG_GENERATE or VLLM_GENERATE: its gateway"
                " session sends the policy exact token ids",
                field="policy.api",
            )
        if harness != DEFAULT_HARNESS and opts.dynamic_history:
            raise InvalidEpisodeStart(
                "options.dynamic_history needs the builtin harness: a harness episode's samples"
                " are its gateway session's chains",
                field="options.dynamic_history",
            )
        params = sampling_params_of(MessageToDict(start.policy.sampling_params))
        if api == pb.POLICY_API_VLLM_GENERATE:
            try:  # refused here, before the episode leases a sandbox
                vllm_sampling_params(params)
            except UnsupportedSamplingParam as err:
                raise InvalidEpisodeStart(
                    err.message, field=f"policy.sampling_params.{err.key}"
                ) from None
        max_new = limits.max_new_tokens or int(params.get("max_new_tokens") or d.max_new_tokens)
        prm = start.prm
        return EpisodeSpec(
            episode_id=start.episode_id,
            instance=start.instance,
            config=config,
            api=api,
            endpoint=start.policy.endpoint,
            model=start.policy.model,
            sampling_params=params,
            request_timeout_s=seconds_of(start.policy.request_timeout)
            or self.settings.policy_request_timeout_s,
            max_turns=max_turns,
            max_context_tokens=limits.max_context_tokens or d.max_context_tokens,
            max_new_tokens=max_new,
            wall_timeout_s=seconds_of(limits.wall_timeout) or d.wall_timeout_s,
            command_timeout_s=seconds_of(limits.command_timeout) or d.command_timeout_s,
            eval_timeout_s=seconds_of(limits.eval_timeout) or d.eval_timeout_s,
            dynamic_history=opts.dynamic_history,
            return_routed_experts=start.policy.return_routed_experts,
            lora_path=start.policy.lora_path,
            request_id_prefix=start.policy.request_id_prefix,
            cache_key=start.policy.cache_key,
            artifact_dir=opts.artifact_dir,
            skip_evaluation=opts.skip_evaluation,
            env=dict(opts.env),
            owner=opts.owner,
            avoid_node_ids=tuple(opts.avoid_node_ids),
            prm=PrmSpec(
                enabled=prm.enabled,
                endpoint=prm_endpoint,
                m=prm.m,
                coef=prm.coef,
                seed=prm.seed,
                timeout_s=seconds_of(prm.timeout) or PRM_STEP_TIMEOUT_S,
            ),
            branch_at=branch.at_turn,
            branch_count=branch.count,
            harness=harness,
            tokenizer_path=start.policy.tokenizer_path,
        )

    async def _policy(self, spec: EpisodeSpec, tokenizer_path: str) -> Policy:
        """The episode's policy in its mode: exact tokens (SGLang, vLLM) or chat text (OpenAI)."""
        settings = self.settings
        # One stable key on every call of the episode: a consistent-hashing router sends all
        # its turns to one engine, whose prefix cache then holds the episode's context.
        header = settings.routing_key_header
        headers = {header: spec.episode_id} if header else {}
        if spec.api in TOKEN_APIS:
            codec = await self.codec(tokenizer_path, spec.config.template_kwargs())
            client: SglangPolicy | VllmPolicy
            if spec.api == pb.POLICY_API_VLLM_GENERATE:
                client = VllmPolicy(
                    self.session(),
                    spec.endpoint,
                    spec.sampling_params,
                    request_timeout_s=spec.request_timeout_s,
                    model=spec.model,
                    lora_path=spec.lora_path,
                    executor=self.executor,
                    retrying=self.policy_retrying,
                    headers=headers,
                    request_key=spec.episode_id,
                )
            else:
                client = SglangPolicy(
                    self.session(),
                    spec.endpoint,
                    spec.sampling_params,
                    request_timeout_s=spec.request_timeout_s,
                    executor=self.executor,
                    retrying=self.policy_retrying,
                    headers=headers,
                    return_routed_experts=spec.return_routed_experts,
                    lora_path=spec.lora_path,
                    request_id_prefix=spec.request_id_prefix,
                    cache_key=spec.cache_key,
                )
            config = spec.config

            def omission_text(n_omitted: int) -> str:
                return config.render("omission_template", n_omitted=n_omitted)

            return TokenMode(
                client,
                codec,
                max_context_tokens=spec.max_context_tokens,
                max_new_tokens=spec.max_new_tokens,
                omission_text=omission_text,
                executor=self.executor,
                tokenizer_pool=self.tokenizer_pool,
                drop_reasoning=config.history_reasoning == "drop",
            )
        key = settings.openai_api_key
        chat = OpenAIChatPolicy(
            self.session(),
            spec.endpoint,
            spec.model,
            spec.sampling_params,
            request_timeout_s=spec.request_timeout_s,
            api_key=key.get_secret_value() if key else None,
            connect_attempts=settings.policy_connect_attempts,
            connect_max_delay_s=settings.policy_connect_max_delay_s,
            headers=headers,
            tools=spec.config.tools if spec.config.tool_calls else (),
        )
        return ChatMode(chat, max_new_tokens=spec.max_new_tokens)

    async def stream(
        self, requests: AsyncIterator[pb.RunEpisodeRequest]
    ) -> AsyncIterator[pb.RunEpisodeResponse]:
        first = await anext(requests, None)
        if first is None or first.WhichOneof("kind") != "start":
            raise StartRequired("the first RunEpisode message must be `start`")
        await self._start_gate.wait_turn()
        spec = self._spec(first.start)
        if spec.episode_id in self.running:
            raise EpisodeRunning(
                f"episode {spec.episode_id} is running", episode_id=spec.episode_id
            )
        if len(self.running) >= self.settings.max_episodes:
            raise AgentAtCapacity(
                f"this agent runs {len(self.running)} episodes (max_episodes)",
                max_episodes=self.settings.max_episodes,
            )
        policy = await self._policy(spec, first.start.policy.tokenizer_path)
        judge: StepJudge | None = None
        if spec.prm.enabled and self._judge_factory is not None:
            judge = self._judge_factory(spec.prm, spec.episode_id)
        queue: asyncio.Queue[pb.RunEpisodeResponse | None] = asyncio.Queue()
        episode = Episode(spec, policy=policy, deps=self._deps, emit=queue.put_nowait, judge=judge)
        self.running[spec.episode_id] = episode

        async def listen() -> None:
            async for request in requests:
                if request.WhichOneof("kind") == "cancel":
                    episode.cancel(request.cancel.reason)

        listener = asyncio.ensure_future(listen())
        work = asyncio.ensure_future(episode.run())
        # The end of the episode is one more queue item, so each message costs one queue get.
        work.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (message := await queue.get()) is not None:
                yield message
            yield work.result()
        finally:
            listener.cancel()
            if not work.done():
                # The call itself went away: stop the episode and wait for its lease release.
                work.cancel()
                with contextlib.suppress(BaseException):
                    await work
            self.running.pop(spec.episode_id, None)
