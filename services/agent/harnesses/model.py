"""A harness episode's model: its own gateway session, opened for the episode's policy.

The episode opens the session before the harness starts (inside its time budget) with the
episode's policy endpoint, tokenizer, sampling parameters, LoRA adapter and token limits; the
harness gets the session's base URLs and secret (`HarnessModel`) and talks its own API to it.
While the harness runs, `guard` watches the session: a policy that is down (the gateway's
policy client gave up after its retries), a trainer abort of a generation, or the gateway
itself going away end the run at once, whatever the harness does with the error it was
answered. At the end `close` ends the session and builds its records: one per chain of the
session's call tree, exactly the tokens the policy was sent and sampled (mask 1 only on sampled
ids), which the episode returns as its samples, graded with its reward.

Pure domain: no gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from swerl.agent.errors import EpisodeInfraError
from swerl.agent.gateway.artifacts import session_json
from swerl.agent.gateway.service import Gateway
from swerl.agent.gateway.session import (
    ENGINE_SGLANG,
    ENGINE_VLLM,
    Session,
    SessionSpec,
    SessionState,
)
from swerl.agent.gateway.wire import session_pb
from swerl.agent.harnesses.base import HarnessModel
from swerl.agent.policy.tokens import TokenRecordData
from swerl.agent.spec import EpisodeSpec
from swerl.agent.v1 import agent_pb2 as pb
from swerl.chassis.errors import SwerlError

T = TypeVar("T")


class PolicyAborted(Exception):
    """The trainer aborted a generation of the session (the episode ends ABORTED)."""


def session_spec(spec: EpisodeSpec) -> SessionSpec:
    """The gateway session of a harness episode: the episode's policy and limits."""
    config = spec.config
    return SessionSpec(
        endpoint=spec.endpoint,
        tokenizer_path=spec.tokenizer_path,
        model=spec.model or "swerl-policy",
        sampling_params=dict(spec.sampling_params),
        request_timeout_s=spec.request_timeout_s,
        max_context_tokens=spec.max_context_tokens,
        max_new_tokens=spec.max_new_tokens,
        lora_path=spec.lora_path,
        request_id_prefix=spec.request_id_prefix,
        cache_key=spec.cache_key,
        # The agent config's parsers; where it names none the session's defaults apply
        # (swerl.agent.gateway.parsing, their one owner).
        tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser,
        template_kwargs=dict(config.chat_template_kwargs),
        owner=spec.lease_owner,
        engine=ENGINE_VLLM if spec.api == pb.POLICY_API_VLLM_GENERATE else ENGINE_SGLANG,
    )


class EpisodeModel:
    """One harness episode's gateway session."""

    def __init__(self, gateway: Gateway, session: Session) -> None:
        self.gateway = gateway
        self.session = session
        self.records: list[TokenRecordData] | None = None
        self.model = HarnessModel(
            session_id=session.id,
            api_key=session.secret,
            model=session.spec.model,
            openai_base_url=gateway.openai_base_url(session),
            anthropic_base_url=gateway.anthropic_base_url(session),
        )

    @classmethod
    async def open(cls, gateway: Gateway, spec: EpisodeSpec, key: str) -> EpisodeModel:
        """Opens the session (idempotent per episode run `key`). A gateway that cannot open it
        (at its session limit, its tokenizer unloadable) is the episode's infra failure."""
        try:
            session = await gateway.store.open(session_spec(spec), request_id=f"{key}-harness")
        except SwerlError as err:
            raise EpisodeInfraError(err.reason, str(err)) from err
        return cls(gateway, session)

    def _failure(self) -> BaseException | None:
        """Why the harness cannot go on with its model (None: it can)."""
        session = self.session
        if self.gateway.stopped.is_set():
            return EpisodeInfraError(
                "GATEWAY_GONE", f"the model gateway at {self.gateway.url} went away mid-run"
            )
        failure = session.policy_failure
        if failure is not None:
            return EpisodeInfraError(failure.reason, failure.message)
        if session.state is SessionState.ABORTED:
            return PolicyAborted("the trainer aborted the policy's generation")
        return None

    async def guard(self, work: Awaitable[T]) -> T:
        """`work` (the harness's run), ended at once when the model fails under it: raises
        EpisodeInfraError (policy down, gateway gone) or PolicyAborted."""
        task = asyncio.ensure_future(work)
        watchers = [
            asyncio.ensure_future(self.gateway.stopped.wait()),
            asyncio.ensure_future(self.session.failed.wait()),
        ]
        try:
            while True:
                waiting = {task, *(w for w in watchers if not w.done())}
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                failure = self._failure()
                if failure is not None:
                    break
                if task.done():
                    return task.result()
        finally:
            for watcher in watchers:
                watcher.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        raise failure

    @property
    def context_exhausted(self) -> bool:
        """The session refused a call over the episode's context budget (a harness that then
        fails ends LIMIT_CONTEXT, not HARNESS_FAILED)."""
        return self.session.state is SessionState.LIMIT_CONTEXT

    async def close(self) -> list[TokenRecordData]:
        """Ends the session (idempotent) and returns its records, built in the CPU pool."""
        if self.records is None:
            store = self.gateway.store
            self.records = await store.aclose(self.session.id, request_id=f"{self.session.id}-end")
        return self.records

    def tree_json(self) -> dict[str, Any]:
        """The session's call tree as `session.json` holds it (what `swerl inspect` shows for
        the episode): the shape a closed gateway session's folder has."""
        return session_json(session_pb(self.session))

    def metrics(self) -> dict[str, float]:
        """The session's figures (`gateway_calls`, `model_query_time_sum`, ...)."""
        return self.session.counters.metrics(self.session.tree)
