"""Settings: defaults < SWERL_<SVC>_* env vars < CLI flags, one flag per field, safe defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import Field, ValidationError
from pydantic_settings import SettingsConfigDict

from swerl.chassis.settings import ServiceSettings, add_settings_arguments, settings_from_args


class XSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SWERL_X_")

    port: int = 7000
    cap_add: list[str] = Field(default_factory=lambda: ["CHOWN"])
    labels: dict[str, str] = Field(default_factory=dict)


def _parse(*argv: str) -> XSettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, XSettings)
    return settings_from_args(XSettings, parser.parse_args(argv))


@pytest.fixture(autouse=True)
def _token(monkeypatch):
    monkeypatch.setenv("SWERL_X_AUTH_TOKEN", "env-token")


def test_defaults_apply_when_neither_env_nor_flag_is_set():
    settings = _parse()

    assert settings.port == 7000
    assert settings.host == "0.0.0.0"
    assert settings.metrics_port is None
    assert settings.insecure is False
    assert settings.log_format == "console"
    assert settings.drain_grace_s == 10.0


def test_env_var_overrides_the_default(monkeypatch):
    monkeypatch.setenv("SWERL_X_PORT", "7100")

    assert _parse().port == 7100


def test_flag_overrides_the_env_var(monkeypatch):
    monkeypatch.setenv("SWERL_X_PORT", "7100")
    monkeypatch.setenv("SWERL_X_METRICS_PORT", "9100")

    settings = _parse("--port", "7200", "--metrics-port", "9200")

    assert (settings.port, settings.metrics_port) == (7200, 9200)


def test_secret_token_comes_from_env_or_flag_and_is_not_printed():
    assert _parse().auth_token.get_secret_value() == "env-token"

    settings = _parse("--auth-token", "flag-token")

    assert settings.auth_token.get_secret_value() == "flag-token"
    assert "flag-token" not in repr(settings)


def test_bool_flags_come_as_a_pair_and_override_env(monkeypatch):
    monkeypatch.setenv("SWERL_X_INSECURE", "true")

    assert _parse().insecure is True
    assert _parse("--no-insecure").insecure is False
    assert _parse("--insecure").insecure is True


def test_none_on_the_command_line_disables_an_optional_setting(monkeypatch):
    monkeypatch.setenv("SWERL_X_METRICS_PORT", "9100")

    assert _parse("--metrics-port", "none").metrics_port is None


def test_every_field_has_a_kebab_case_flag():
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, XSettings)
    flags = {option for action in parser._actions for option in action.option_strings}

    for name in XSettings.model_fields:
        assert "--" + name.replace("_", "-") in flags


def test_log_format_outside_its_choices_is_rejected_by_the_parser():
    with pytest.raises(SystemExit):
        _parse("--log-format", "xml")


def test_bad_values_are_rejected_with_the_setting_named():
    with pytest.raises(ValidationError, match="port"):
        _parse("--port", "not-a-number")


def test_missing_token_refuses_to_start_unless_insecure(monkeypatch):
    monkeypatch.delenv("SWERL_X_AUTH_TOKEN")

    with pytest.raises(ValidationError, match=r"auth_token is required.*--insecure"):
        _parse()
    assert _parse("--insecure").auth_token is None


def test_tls_certificate_without_its_key_is_rejected(tmp_path: Path):
    with pytest.raises(ValidationError, match="tls_cert_file and tls_key_file"):
        _parse("--tls-cert-file", str(tmp_path / "server.crt"))


def test_client_ca_without_a_server_certificate_is_rejected(tmp_path: Path):
    with pytest.raises(ValidationError, match="tls_client_ca_file needs"):
        _parse("--tls-client-ca-file", str(tmp_path / "ca.crt"))


def test_list_settings_take_several_values_and_dicts_take_json(monkeypatch):
    monkeypatch.setenv("SWERL_X_CAP_ADD", '["KILL"]')

    assert _parse().cap_add == ["KILL"]
    settings = _parse("--cap-add", "SETUID", "SETGID", "--labels", '{"team": "rl"}')

    assert settings.cap_add == ["SETUID", "SETGID"]
    assert settings.labels == {"team": "rl"}
