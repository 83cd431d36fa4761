"""Bad input to the CLI ends in human lines on stderr and a non-zero status, never a traceback."""

from __future__ import annotations

from swerl.cli import main


def test_invalid_settings_are_one_line_per_problem_without_pydantic_links(capsys, monkeypatch):
    monkeypatch.delenv("SWERL_PRM_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("SWERL_PRM_INSECURE", raising=False)
    assert main(["prm", "serve"]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines and all(line.startswith("swerl: invalid setting ") for line in lines)
    assert "auth_token is required" in err
    assert "errors.pydantic.dev" not in err and "Traceback" not in err


def test_a_missing_tasks_directory_is_one_line(tmp_path, capsys):
    assert main(["tasks", "build", "--tasks", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("swerl: ") and err.count("\n") == 1
    assert "tasks directory not found" in err
