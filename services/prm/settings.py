"""Settings of the PRM judge service (`swerl prm serve`): SWERL_PRM_* env vars and CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from swerl.chassis.settings import ServiceSettings
from swerl.prm.prompt import PromptLimits


class PrmSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SWERL_PRM_", extra="ignore")

    port: int = 18092
    backend: Literal["sglang", "openai"] = Field(
        "sglang",
        description="'sglang': the judge's router /generate with input_ids rendered here with the"
        " judge's own tokenizer; 'openai': an OpenAI-compatible /v1/chat/completions endpoint",
    )
    judge_url: str = Field(
        "http://127.0.0.1:30000",
        description="base URL of the judge model's SGLang router, or of the OpenAI-style API",
    )
    judge_tokenizer_path: Path | None = Field(
        None,
        description="local Hugging Face tokenizer directory of the JUDGE model (not the policy's);"
        " required for the sglang backend",
    )
    judge_model: str = Field(
        "",
        description="model name sent to an OpenAI-style API; also reported as judge_model"
        " (default: what the server reports)",
    )
    judge_api_key: SecretStr | None = Field(None, description="bearer key of the OpenAI-style API")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="extra variables for the judge's chat template (JSON, e.g."
        ' {"enable_thinking": false})',
    )
    routing_key_header: str = Field(
        "X-SMG-Routing-Key",
        description="HTTP header that carries the judged step's episode id on every call to the"
        " judge model, so a consistent-hashing router keeps an episode's votes on one engine;"
        " empty sends none",
    )
    default_votes: int = Field(3, ge=1, description="votes per step when a request says 0")
    max_votes: int = Field(16, ge=1, description="most votes a request may ask for")
    max_concurrent_requests: int = Field(
        64, ge=1, description="judge model calls in flight at once, across all judgments"
    )
    request_timeout_s: float = Field(
        120.0, gt=0, description="limit on one call to the judge model (one vote)"
    )
    retry_max_attempts: int = Field(
        3, ge=1, description="attempts per vote when the judge's server cannot be reached"
    )
    retry_max_delay_s: float = Field(10.0, ge=0, description="give up retrying a vote after this")
    temperature: float = Field(1.0, ge=0, description="sampling temperature of the votes")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of the votes")
    max_new_tokens: int = Field(4096, ge=1, description="longest answer of one vote, in tokens")
    max_prompt_tokens: int = Field(
        0,
        ge=0,
        description="judge prompt budget in tokens (sglang backend); longer prompts are cut"
        " further; 0 = no budget",
    )
    max_issue_chars: int = Field(8000, ge=0, description="issue text kept in the prompt")
    history_steps: int = Field(8, ge=0, description="earlier steps shown to the judge")
    history_output_chars: int = Field(1000, ge=0, description="output kept per earlier step")
    step_output_chars: int = Field(4000, ge=0, description="output kept of the judged step")
    step_response_chars: int = Field(16000, ge=1, description="response kept of the judged step")

    def problems(self) -> list[str]:
        problems = super().problems()
        if self.backend == "sglang" and self.judge_tokenizer_path is None:
            problems.append(
                "judge_tokenizer_path is required for the sglang backend: the judge prompt is"
                " tokenized with the judge model's own tokenizer (--judge-tokenizer-path or"
                " SWERL_PRM_JUDGE_TOKENIZER_PATH)"
            )
        if self.backend == "openai" and not self.judge_model:
            problems.append("judge_model is required for the openai backend")
        if self.default_votes > self.max_votes:
            problems.append("default_votes must not exceed max_votes")
        return problems

    def prompt_limits(self) -> PromptLimits:
        return PromptLimits(
            max_issue_chars=self.max_issue_chars,
            history_steps=self.history_steps,
            history_output_chars=self.history_output_chars,
            step_output_chars=self.step_output_chars,
            step_response_chars=self.step_response_chars,
        )
