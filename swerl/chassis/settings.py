"""Settings every swerl server shares: CLI flags, then `SWERL_<SVC>_*` env vars, then defaults.

Each service subclasses `ServiceSettings`, sets its env prefix and default port, and adds its own
fields; `add_settings_arguments` turns every field into a CLI flag of the same name, so
`SWERL_EXEC_METRICS_PORT` and `--metrics-port` are the same setting.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

SettingsT = TypeVar("SettingsT", bound="ServiceSettings")


class ServiceSettings(BaseSettings):
    """Base settings of a gRPC server. Subclasses set `env_prefix` and a default `port`."""

    model_config = SettingsConfigDict(env_prefix="SWERL_")

    host: str = Field("0.0.0.0", description="Interface the gRPC server binds to.")
    port: int = Field(ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Prometheus HTTP port; 0 picks a free one; unset (or 'none') disables it.",
    )
    auth_token: SecretStr | None = Field(
        None, description="Bearer token every call must carry (required unless --insecure)."
    )
    insecure: bool = Field(
        False, description="Accept calls without a bearer token (local development only)."
    )
    tls_cert_file: Path | None = Field(None, description="PEM server certificate (enables TLS).")
    tls_key_file: Path | None = Field(None, description="PEM private key of the certificate.")
    tls_client_ca_file: Path | None = Field(
        None, description="PEM CA bundle; when set, clients must present a certificate it signed."
    )
    log_format: Literal["console", "json"] = Field(
        "console", description="'json' in production, 'console' for development."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Lowest log level written."
    )
    drain_grace_s: float = Field(
        10.0, ge=0, description="Seconds in-flight calls get to finish on SIGTERM."
    )

    @field_validator("auth_token", mode="before")
    @classmethod
    def _empty_token_is_no_token(cls, value: object) -> object:
        # `SWERL_EXEC_AUTH_TOKEN=` must not become a valid empty token.
        return None if value == "" else value

    @field_validator("port", "metrics_port")
    @classmethod
    def _port_in_range(cls, value: int | None) -> int | None:
        # Subclasses redefine `port` with their default, which drops the Field bounds above; a
        # port past 65535 would otherwise be bound modulo 65536 (99999 serves on 34463).
        if value is not None and not 0 <= value <= 65535:
            raise ValueError(f"must be 0-65535 (0 picks a free one), not {value}")
        return value

    def problems(self) -> list[str]:
        """What is wrong with these settings as a whole, one human sentence per problem. A
        subclass adds its own to the base's (`problems = super().problems()`), so that a command
        reports every problem at once, not one per try."""
        problems = []
        prefix = self.model_config.get("env_prefix", "")
        if self.auth_token is None and not self.insecure:
            problems.append(
                f"auth_token is required: set --auth-token or {prefix}AUTH_TOKEN, "
                f"or start with --insecure ({prefix}INSECURE=true) for local development"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            problems.append("tls_cert_file and tls_key_file must be set together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            problems.append("tls_client_ca_file needs tls_cert_file and tls_key_file")
        return problems

    @model_validator(mode="after")
    def _check_problems(self) -> ServiceSettings:
        problems = self.problems()
        if problems:
            # One ValueError, one problem per line (the `swerl` command prints a line each).
            raise ValueError("\n".join(problems))
        return self


def add_settings_arguments(
    parser: argparse.ArgumentParser, settings_cls: type[ServiceSettings]
) -> None:
    """Adds one flag per settings field (`--metrics-port`, `--insecure/--no-insecure`, ...).

    Flags default to "absent" so that an unset flag leaves the env var or default in force.
    """
    for name, field in settings_cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            parser.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=field.description,
            )
            continue
        choices = _literal_choices(field.annotation)
        origin = typing.get_origin(field.annotation)
        shape: dict[str, Any] = {}
        # Lists take several values (`--cap-add CHOWN KILL`); dicts take a JSON object.
        if origin in (list, tuple, set, frozenset):
            shape["nargs"] = "*"
        elif origin is dict:
            shape["type"] = json.loads
        parser.add_argument(
            flag,
            dest=name,
            default=argparse.SUPPRESS,
            choices=choices,
            metavar=None if choices else name.upper(),
            help=field.description,
            **shape,
        )


def settings_from_args(settings_cls: type[SettingsT], namespace: argparse.Namespace) -> SettingsT:
    """Builds `settings_cls` from parsed flags; flags override env vars, which override defaults.

    Raises pydantic's ValidationError (a ValueError) naming each bad setting.
    """
    values: dict[str, Any] = {}
    for name, field in settings_cls.model_fields.items():
        if not hasattr(namespace, name):
            continue
        value = getattr(namespace, name)
        if _allows_none(field.annotation) and isinstance(value, str):
            value = None if value.strip().lower() in ("", "none") else value
        values[name] = value
    # Init kwargs take precedence over env vars in pydantic-settings; pydantic converts the strings.
    return settings_cls(**values)


def _literal_choices(annotation: object) -> list[str] | None:
    if typing.get_origin(annotation) is Literal:
        return [str(choice) for choice in typing.get_args(annotation)]
    return None


def _allows_none(annotation: object) -> bool:
    origin = typing.get_origin(annotation)
    return origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(annotation)
