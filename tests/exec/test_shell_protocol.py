"""The shell protocol's written form and its turn: the tests' citations of docs/shell-protocol.md
name rows that exist there, and the shell's turn has one owner that hands it on in order."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from swerl.exec.shell import SandboxShell

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "shell-protocol.md"
ROW = re.compile(r"\b([CNI][0-9]+)\b")


def _rows_in_doc() -> set[str]:
    text = DOC.read_text()
    table_rows = set(re.findall(r"^\| ([CN][0-9]+) \|", text, re.M))
    invariants = set(re.findall(r"^- \*\*(I[0-9]+) ", text, re.M))
    return table_rows | invariants


def _citations() -> dict[str, set[str]]:
    cited: dict[str, set[str]] = {}
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for line in path.read_text().splitlines():
            _, marker, rows = line.partition("# docs/shell-protocol.md:")
            if marker:
                cited.setdefault(path.name, set()).update(ROW.findall(rows))
    return cited


def test_rows_the_tests_cite_exist_in_the_protocol_document():
    rows = _rows_in_doc()
    # Both sides' tables and the invariants are there, numbered without gaps.
    for prefix in "CNI":
        numbers = sorted(int(row[1:]) for row in rows if row[0] == prefix)
        assert numbers == list(range(1, len(numbers) + 1)), prefix
    cited = _citations()
    assert len(cited) >= 4, "the exec tests no longer cite the protocol document"
    for name, names in cited.items():
        assert names <= rows, f"{name} cites rows the document does not have: {names - rows}"


async def test_the_shells_turn_goes_in_arrival_order_and_only_its_holder_ends_it(tmp_path):
    # docs/shell-protocol.md: I1, "the turn" (no container is needed: the turn is the node's)
    shell = SandboxShell(None, "0" * 12, tmp_path, {})
    first, second, third = object(), object(), object()
    order: list[object] = []

    async def take(holder: object) -> None:
        await shell.take_turn(holder)
        order.append(holder)

    await take(first)
    waiting = [asyncio.ensure_future(take(second))]
    await asyncio.sleep(0)
    waiting.append(asyncio.ensure_future(take(third)))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError):
        shell.end_turn(second)  # waiting in line is not holding
    assert order == [first]
    shell.end_turn(first)
    await asyncio.sleep(0)
    assert order == [first, second]
    shell.end_turn(second)
    await asyncio.gather(*waiting)
    assert order == [first, second, third]
    shell.end_turn(third)
