"""A browser test whose screenshot chromium did not write fails (selenium only returns False)."""

from __future__ import annotations

import pytest
from testkit.web import save_screenshot


class _Driver:
    def __init__(self, writes: bool) -> None:
        self.writes = writes

    def save_screenshot(self, filename: str) -> bool:
        if self.writes:
            with open(filename, "wb") as out:
                out.write(b"\x89PNG\r\n\x1a\n")
        return self.writes


def test_a_screenshot_chromium_did_not_save_fails_the_test(tmp_path):
    with pytest.raises(AssertionError, match="did not save the screenshot"):
        save_screenshot(_Driver(writes=False), tmp_path / "page.png")


def test_a_saved_screenshot_is_returned(tmp_path):
    assert save_screenshot(_Driver(writes=True), tmp_path / "page.png").stat().st_size > 0
