"""Settings of the E2B-compatible face (`swerl e2b serve`): SWERL_E2B_* env vars and CLI flags."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from swerl.chassis.settings import ServiceSettings


class E2BSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SWERL_E2B_", extra="ignore")

    # E2B's own debug ports are the defaults, so `E2B_API_URL=http://HOST:3000` and
    # `E2B_SANDBOX_URL=http://HOST:49983` reach it.
    port: int = Field(3000, description="port of the control API (REST; also --api-port)")
    envd_port: int = Field(
        49983, ge=0, le=65535, description="port of the sandbox API (envd: commands and files)"
    )
    pool: str | None = Field(
        None,
        description="address of the pool (host:port); unset runs an in-process pool and exec"
        " node on the local dockerd, as `swerl demo` does",
    )
    pool_token: SecretStr | None = Field(
        None, description="bearer token of the pool and its nodes (default: auth_token)"
    )
    image_metadata_key: str = Field(
        "",
        description="metadata key whose value is the sandbox's image (slime's"
        " SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY); otherwise the template id is the image",
    )
    templates: dict[str, str] = Field(
        default_factory=lambda: {"base": "swerl-base:bookworm"},
        description="template ids that name an image by another name (JSON object)",
    )
    default_timeout_s: int = Field(
        300, ge=1, description="sandbox lifetime when a create gives none (E2B's default)"
    )
    max_timeout_s: int = Field(
        24 * 3600, ge=1, description="longest sandbox lifetime a create or set-timeout may ask"
    )
    lease_ttl_s: float = Field(
        60.0,
        gt=0,
        description="TTL of the pool leases behind sandboxes, renewed while the face runs: if"
        " the face dies its sandboxes are reaped within this",
    )
    acquire_wait_s: float = Field(
        300.0, gt=0, description="how long a create waits for capacity and its image's pull"
    )
    max_file_bytes: int = Field(
        1 << 30, ge=1, description="largest file one /files upload may write"
    )
    max_output_bytes: int = Field(
        64 << 20, ge=1, description="output cap of one command (the node's limit applies)"
    )
    max_poll_bytes: int = Field(
        4 << 20,
        ge=1,
        description="most of each output stream one poll of a running process reads (held"
        " under max_output_bytes)",
    )
    embedded_max_sandboxes: int = Field(
        8, ge=1, description="sandboxes the embedded node hosts at once (no --pool)"
    )

    def problems(self) -> list[str]:
        problems = super().problems()
        if self.metrics_port is not None:
            # The face has no Prometheus endpoint of its own; the pool and nodes have theirs.
            problems.append("metrics_port is not served by the E2B face; leave it unset")
        return problems

    def pool_bearer(self) -> str | None:
        secret = self.pool_token or self.auth_token
        return secret.get_secret_value() if secret is not None else None
