"""Helpers of the browser tests: console errors of a page, and a `swerl` web command run as a
user runs it."""

from __future__ import annotations

import re
import subprocess
import sys

from selenium import webdriver


def console_errors(driver: webdriver.Chrome) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


class Served:
    """`swerl inspect` (or dashboard) as a user runs it: a subprocess, its URL read from stdout."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swerl.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.url = ""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            match = re.search(r"(http://\S+/)", line)
            if match:
                self.url = match.group(1).rstrip("/")
                break
        assert self.url, "".join(self.lines)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
