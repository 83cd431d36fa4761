"""Bad input to the CLI ends in human lines on stderr and a non-zero status, never a traceback."""

from __future__ import annotations

from swerl.cli import main


def test_invalid_settings_are_one_line_per_problem_without_pydantic_links(capsys, monkeypatch):
    monkeypatch.delenv("SWERL_PRM_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("SWERL_PRM_INSECURE", raising=False)
    assert main(["prm", "serve"]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines and all(line.startswith("swerl: invalid setting") for line in lines)
    assert "auth_token is required" in err
    assert "errors.pydantic.dev" not in err and "Traceback" not in err


def test_prm_serve_without_token_and_judge_tokenizer_names_both_problems(capsys, monkeypatch):
    # Issue 17's example: every problem at once, one human sentence a line, none of pydantic's
    # wording ("Value error,", the settings class, its documentation URL).
    for name in ("AUTH_TOKEN", "INSECURE", "JUDGE_TOKENIZER_PATH", "BACKEND"):
        monkeypatch.delenv(f"SWERL_PRM_{name}", raising=False)
    assert main(["prm", "serve"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("swerl: invalid setting: auth_token is required")
    assert lines[1].startswith("swerl: invalid setting: judge_tokenizer_path is required")
    for line in lines:
        assert "Value error" not in line and "PrmSettings" not in line and "pydantic" not in line


def test_a_port_out_of_range_is_refused_not_bound_modulo_65536(capsys, monkeypatch):
    # Every service redefines `port` with its own default; 99999 used to serve on 34463.
    monkeypatch.delenv("SWERL_POOL_PORT", raising=False)
    assert main(["pool", "serve", "--insecure", "--port", "99999", "--metrics-port", "70000"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "swerl: invalid setting port: must be 0-65535 (0 picks a free one), not 99999",
        "swerl: invalid setting metrics_port: Input should be less than or equal to 65535",
    ]


def test_a_missing_tasks_directory_is_one_line(tmp_path, capsys):
    assert main(["tasks", "build", "--tasks", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("swerl: ") and err.count("\n") == 1
    assert "tasks directory not found" in err
