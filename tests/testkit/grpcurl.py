"""grpcurl as an operator runs it, for the tests that drive services through it: the binary
(from PATH, else installed by scripts/install-grpcurl.sh: the `grpcurl_bin` fixture of
tests/conftest.py), one plaintext target with the bearer token, and its JSON output read back."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from testkit.exec import TOKEN

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPO_ROOT / "scripts" / "install-grpcurl.sh"
GRPCURL_TIMEOUT_S = 120


def find_or_install_grpcurl(tmp_path_factory: pytest.TempPathFactory) -> str:
    """grpcurl from PATH, else installed by scripts/install-grpcurl.sh into a temp dir.

    Not having it is a failure: CI runs the install script first (scripts/test).
    """
    found = shutil.which("grpcurl")
    if found:
        return found
    bin_dir = tmp_path_factory.mktemp("grpcurl-bin")
    install = subprocess.run(
        ["bash", str(INSTALL_SCRIPT)],
        env={**os.environ, "GRPCURL_BIN_DIR": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    binary = bin_dir / "grpcurl"
    if install.returncode != 0 or not os.access(binary, os.X_OK):
        pytest.fail(
            f"could not install grpcurl with {INSTALL_SCRIPT} (rc {install.returncode}):\n"
            f"{install.stdout}{install.stderr}"
        )
    return str(binary)


class Grpcurl:
    """Runs grpcurl against one plaintext node, with the bearer token unless told otherwise.

    `command` is what follows the address (`list`, `describe X`, `Service/Method`); `flags` go
    before it, as grpcurl wants.
    """

    def __init__(self, binary: str, address: str) -> None:
        self.binary = binary
        self.address = address

    async def __call__(
        self,
        *command: str,
        flags: tuple[str, ...] = (),
        token: str | None = TOKEN,
        stdin: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        auth = ("-H", f"authorization: Bearer {token}") if token else ()
        argv = [self.binary, "-plaintext", *auth, *flags, self.address, *command]
        return await asyncio.to_thread(
            subprocess.run,
            argv,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=GRPCURL_TIMEOUT_S,
        )

    async def ok(self, *command: str, flags: tuple[str, ...] = (), stdin: str | None = None) -> str:
        done = await self(*command, flags=flags, stdin=stdin)
        assert done.returncode == 0, f"grpcurl {flags} {command} failed:\n{done.stderr}"
        return done.stdout


def json_messages(text: str) -> list[dict[str, Any]]:
    """grpcurl prints one pretty JSON object per response message, back to back, with the
    proto field names (`sandbox_id`, not `sandboxId`)."""
    decoder = json.JSONDecoder()
    messages: list[dict[str, Any]] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return messages
        message, pos = decoder.raw_decode(text, pos)
        messages.append(message)
