"""Assembles the PRM service: judge backend from settings, the judge, the gRPC server."""

from __future__ import annotations

from swerl.chassis.server import GrpcServer, ServiceHost
from swerl.prm.backends import JudgeBackend, OpenAIChatBackend, SamplingConfig, SglangBackend
from swerl.prm.judge import Judge, JudgeConfig
from swerl.prm.servicer import PrmServicer
from swerl.prm.settings import PrmSettings
from swerl.prm.v1 import prm_pb2, prm_pb2_grpc

PRM_SERVICE = prm_pb2.DESCRIPTOR.services_by_name["PrmService"].full_name


def backend_from_settings(settings: PrmSettings) -> JudgeBackend:
    sampling = SamplingConfig(
        temperature=settings.temperature,
        top_p=settings.top_p,
        max_new_tokens=settings.max_new_tokens,
    )
    if settings.backend == "openai":
        key = settings.judge_api_key
        return OpenAIChatBackend(
            settings.judge_url,
            settings.judge_model,
            sampling,
            api_key=key.get_secret_value() if key else None,
            chat_template_kwargs=settings.chat_template_kwargs,
            routing_key_header=settings.routing_key_header,
        )
    assert settings.judge_tokenizer_path is not None  # PrmSettings checks it for sglang.
    return SglangBackend(
        settings.judge_url,
        settings.judge_tokenizer_path,
        sampling,
        model_name=settings.judge_model,
        chat_template_kwargs=settings.chat_template_kwargs,
        routing_key_header=settings.routing_key_header,
    )


def judge_config(settings: PrmSettings) -> JudgeConfig:
    return JudgeConfig(
        default_votes=settings.default_votes,
        max_votes=settings.max_votes,
        max_concurrent_requests=settings.max_concurrent_requests,
        request_timeout_s=settings.request_timeout_s,
        retry_max_attempts=settings.retry_max_attempts,
        retry_max_delay_s=settings.retry_max_delay_s,
        max_prompt_tokens=settings.max_prompt_tokens,
        limits=settings.prompt_limits(),
    )


class PrmServer(ServiceHost):
    """One running PRM service; `start()` then `serve_until_signal()` or `stop()`."""

    def __init__(self, settings: PrmSettings, backend: JudgeBackend | None = None) -> None:
        self.settings = settings
        self.judge = Judge(backend or backend_from_settings(settings), judge_config(settings))
        self.server = GrpcServer(settings, name="prm")
        self.server.add_service(
            prm_pb2_grpc.add_PrmServiceServicer_to_server, PrmServicer(self.judge), [PRM_SERVICE]
        )
        self.server.add_shutdown_callback(self.judge.close)
        self.port = 0
