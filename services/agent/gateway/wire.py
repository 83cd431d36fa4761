"""Gateway sessions as `swerl.agent.v1` messages, and the session RPCs' domain side (what the
servicer calls: protos in, protos out, domain errors raised)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

import structlog
from google.protobuf.json_format import MessageToDict

from swerl.agent.gateway.artifacts import write_session
from swerl.agent.gateway.errors import GatewayDisabled, InvalidSessionSpec
from swerl.agent.gateway.session import (
    ENGINE_SGLANG,
    ENGINE_VLLM,
    Session,
    SessionSpec,
    SessionState,
)
from swerl.agent.gateway.tree import CallKind
from swerl.agent.policy.tokens import TokenRecordData
from swerl.agent.v1 import agent_pb2 as pb
from swerl.chassis.timeconv import seconds_of

T = TypeVar("T")
log = structlog.get_logger("swerl.agent.gateway")

SESSION_STATE_PB: dict[SessionState, pb.SessionStatus] = {
    SessionState.OPEN: pb.SESSION_STATUS_OPEN,
    SessionState.CLOSED: pb.SESSION_STATUS_CLOSED,
    SessionState.LIMIT_CONTEXT: pb.SESSION_STATUS_LIMIT_CONTEXT,
    SessionState.ABORTED: pb.SESSION_STATUS_ABORTED,
}

CALL_KIND_PB: dict[CallKind, pb.SessionCallKind] = {
    CallKind.ROOT: pb.SESSION_CALL_KIND_ROOT,
    CallKind.EXTEND: pb.SESSION_CALL_KIND_EXTEND,
    CallKind.FORK: pb.SESSION_CALL_KIND_FORK,
}

# The token APIs a session may name, as SessionSpec.engine.
_ENGINES = {
    pb.POLICY_API_UNSPECIFIED: ENGINE_SGLANG,
    pb.POLICY_API_SGLANG_GENERATE: ENGINE_SGLANG,
    pb.POLICY_API_VLLM_GENERATE: ENGINE_VLLM,
}
_INTEGER_PARAMS = ("top_k", "max_new_tokens", "min_new_tokens", "sampling_seed", "n")


def _sampling_params(struct: Any) -> dict[str, Any]:
    """Struct numbers are floats; SGLang wants ints for its integer keys."""
    params = MessageToDict(struct)
    for key in _INTEGER_PARAMS:
        value = params.get(key)
        if isinstance(value, float) and value.is_integer():
            params[key] = int(value)
    if isinstance(params.get("stop_token_ids"), list):
        params["stop_token_ids"] = [int(x) for x in params["stop_token_ids"]]
    return params


def spec_of(request: pb.OpenSessionRequest) -> SessionSpec:
    policy = request.policy
    engine = _ENGINES.get(policy.api)
    if engine is None:
        raise InvalidSessionSpec(
            "the gateway records tokens: policy.api must be SGLANG_GENERATE or VLLM_GENERATE",
            field="policy.api",
        )
    for name in ("request_id_prefix", "cache_key"):
        if getattr(policy, name) and policy.api != pb.POLICY_API_SGLANG_GENERATE:
            raise InvalidSessionSpec(
                f"policy.{name} is SGLang's (`rid` prefix / `extra_key`) and needs SGLANG_GENERATE",
                field=f"policy.{name}",
            )
    timeout = seconds_of(policy.request_timeout) if policy.HasField("request_timeout") else 0.0
    return SessionSpec(
        endpoint=policy.endpoint,
        tokenizer_path=policy.tokenizer_path,
        model=policy.model or "swerl-policy",
        sampling_params=_sampling_params(policy.sampling_params),
        request_timeout_s=timeout,
        max_context_tokens=request.max_context_tokens,
        max_new_tokens=request.max_new_tokens,
        lora_path=policy.lora_path,
        request_id_prefix=policy.request_id_prefix,
        cache_key=policy.cache_key,
        tool_call_parser=request.tool_call_parser,
        reasoning_parser=request.reasoning_parser,
        template_kwargs=MessageToDict(request.template_kwargs),
        owner=request.owner,
        artifact_dir=request.artifact_dir,
        engine=engine,
    )


def session_pb(session: Session) -> pb.GetSessionResponse:
    out = pb.GetSessionResponse(
        session_id=session.id,
        status=SESSION_STATE_PB[session.state],
        owner=session.spec.owner,
        infra_errors=session.counters.infra_errors,
        context_errors=session.counters.context_errors,
        calls_in_flight=session.counters.in_flight,
    )
    out.metrics.update(session.counters.metrics(session.tree))
    for node in session.tree.calls:
        call = out.calls.add(
            call_index=node.index,
            kind=CALL_KIND_PB[node.kind],
            protocol=node.protocol,
            prompt_tokens=len(node.prompt_ids),
            reused_tokens=node.reused_tokens,
            sampled_tokens=len(node.output_ids),
            finish_reason=node.finish_reason,
            tool_calls=node.tool_calls,
            request_messages=node.request_messages,
            rendered_messages=node.rendered_messages,
        )
        if node.parent is not None:
            call.parent_call_index = node.parent.index
        call.end_time.FromNanoseconds(int(node.end_time * 1e9))
    return out


def _fill_record(message: pb.TokenRecord, record: TokenRecordData, reward: float | None) -> None:
    record.check()
    message.prompt_ids.extend(record.prompt_ids)
    message.response_ids.extend(record.response_ids)
    message.loss_mask.extend(record.loss_mask)
    message.logprobs.extend(record.logprobs)
    message.weight_versions.extend(record.weight_versions)
    if reward is not None:
        message.reward = reward


def close_pb(
    session: Session, records: list[TokenRecordData], reward: float | None
) -> pb.CloseSessionResponse:
    out = pb.CloseSessionResponse(session_id=session.id, status=SESSION_STATE_PB[session.state])
    for record in records:
        _fill_record(out.records.add(), record, reward)
    out.session.CopyFrom(session_pb(session))
    return out


class SessionRpcs:
    """OpenSession / GetSession / CloseSession over the agent's gateway (None: no gateway)."""

    def __init__(self, gateway: Any | None, executor: Executor | None = None) -> None:
        self._gateway = gateway
        self._executor = executor
        # CloseSession's response per session, so a retry returns the same message.
        self._closed: dict[str, tuple[str, pb.CloseSessionResponse]] = {}

    def _need(self) -> Any:
        if self._gateway is None:
            raise GatewayDisabled(
                "this agent serves no model gateway (start it with --gateway-port)"
            )
        return self._gateway

    async def _cpu(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def open(self, request: pb.OpenSessionRequest) -> pb.OpenSessionResponse:
        gateway = self._need()
        session = await gateway.store.open(spec_of(request), request.request_id)
        return pb.OpenSessionResponse(
            session_id=session.id,
            secret=session.secret,
            openai_base_url=gateway.openai_base_url(session),
            anthropic_base_url=gateway.anthropic_base_url(session),
        )

    def get(self, request: pb.GetSessionRequest) -> pb.GetSessionResponse:
        return session_pb(self._need().store.get(request.session_id))

    async def close(self, request: pb.CloseSessionRequest) -> pb.CloseSessionResponse:
        store = self._need().store
        done = self._closed.get(request.session_id)
        if done is not None and request.request_id and done[0] == request.request_id:
            return done[1]
        records = await store.aclose(
            request.session_id, request_id=request.request_id, abort=request.abort
        )
        session = store.get(request.session_id)
        reward = request.reward if request.HasField("reward") else None
        response = await self._cpu(close_pb, session, records, reward)
        if session.spec.artifact_dir:
            try:
                await self._cpu(write_session, session.spec.artifact_dir, response)
            except OSError as err:
                # The session has ended and its records are returned all the same.
                log.warning("session_artifacts_not_written", session_id=session.id, error=str(err))
        self._closed[request.session_id] = (request.request_id, response)
        while len(self._closed) > 1024:
            self._closed.pop(next(iter(self._closed)))
        return response
