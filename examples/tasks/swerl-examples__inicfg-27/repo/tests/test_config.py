import pytest

from inicfg import Config

SAMPLE = """
debug = off

[server]
port = 8080
verbose = yes
"""


def test_sections_exclude_default():
    assert Config.from_string(SAMPLE).sections() == ["server"]


def test_get_falls_back_to_default_section():
    assert Config.from_string(SAMPLE).get("server", "debug") == "off"


def test_missing_key_raises_key_error():
    with pytest.raises(KeyError):
        Config.from_string(SAMPLE).get("server", "nope")


def test_get_returns_default_for_missing_key():
    assert Config.from_string(SAMPLE).get("server", "nope", "fallback") == "fallback"


def test_getint():
    assert Config.from_string(SAMPLE).getint("server", "port") == 8080


@pytest.mark.parametrize(("text", "expected"), [("yes", True), ("Off", False), ("1", True)])
def test_getbool(text, expected):
    assert Config.from_string(f"[s]\nflag = {text}\n").getbool("s", "flag") is expected


def test_from_file(tmp_path):
    path = tmp_path / "app.ini"
    path.write_text(SAMPLE, encoding="utf-8")
    assert Config.from_file(path).getint("server", "port") == 8080
