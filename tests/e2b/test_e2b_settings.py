"""`swerl e2b serve`'s settings: flags, SWERL_E2B_* variables, and what is refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from swerl.chassis.settings import settings_from_args
from swerl.cli import build_parser, main
from swerl.e2b.settings import E2BSettings


def test_the_defaults_are_e2bs_debug_ports():
    settings = E2BSettings(insecure=True)
    assert (settings.port, settings.envd_port) == (3000, 49983)
    assert settings.pool is None and settings.templates == {"base": "swerl-base:bookworm"}


def test_flags_and_variables_set_the_same_settings(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SWERL_E2B_AUTH_TOKEN", "from-env")
    monkeypatch.setenv("SWERL_E2B_IMAGE_METADATA_KEY", "swerl-image")
    args = build_parser().parse_args(
        ["e2b", "serve", "--api-port", "3100", "--envd-port", "50000", "--templates", '{"a": "b"}']
    )
    settings = settings_from_args(E2BSettings, args)
    assert (settings.port, settings.envd_port) == (3100, 50000)
    assert settings.auth_token is not None and settings.auth_token.get_secret_value() == "from-env"
    assert settings.image_metadata_key == "swerl-image" and settings.templates == {"a": "b"}
    assert settings.pool_bearer() == "from-env"


def test_serving_without_a_token_needs_insecure(monkeypatch: pytest.MonkeyPatch, capsys):
    monkeypatch.delenv("SWERL_E2B_AUTH_TOKEN", raising=False)
    with pytest.raises(ValidationError, match="auth_token is required"):
        E2BSettings()
    assert main(["e2b", "serve"]) == 2
    assert "auth_token is required" in capsys.readouterr().err
    assert main(["e2b", "serve", "--insecure", "--envd-port", "70000"]) == 2
    assert "invalid setting envd_port" in capsys.readouterr().err
