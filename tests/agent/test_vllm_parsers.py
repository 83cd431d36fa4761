"""swerl's tool-call and reasoning parsers against vLLM's own, on the corpus of
tests/agent/data/parser_cases.json (testkit.parser_parity): every reply reads the same or is a
documented difference, and docs/parsers-vs-vllm.md is the table those readings write.

vLLM runs in its own environment (SWERL_VLLM_PYTHON, its python; scripts/vllm-env makes it), in
one subprocess for the whole corpus. As with Ray (SWERL_RAY_SITE), CI always sets the variable,
so there a missing or broken vLLM fails these tests; unset, they are skipped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from testkit.parser_parity import (
    DIFFERENCES,
    SWERL_REASONING_PARSER,
    SWERL_TOOL_PARSER,
    TABLE_PATH,
    compare,
    load_cases,
    render_table,
    run_vllm,
)
from testkit.vllm_engine import wait_for_engine


@pytest.fixture(scope="module")
def readings():
    python = os.environ.get("SWERL_VLLM_PYTHON", "")
    if not python:
        pytest.skip("vLLM's environment is not set up (set SWERL_VLLM_PYTHON to its python)")
    # scripts/test (and so CI) sets it to the environment it builds in the background, and the
    # engine it then serves answering says the build is done: there it must work.
    if os.environ.get("SWERL_VLLM_URL"):
        wait_for_engine()
    assert Path(python).is_file(), f"SWERL_VLLM_PYTHON={python} does not exist"
    corpus = load_cases()
    vllm = run_vllm(python, corpus)
    return compare(corpus, vllm), vllm["vllm_version"]


@pytest.mark.vllm
def test_every_reply_reads_as_vllm_reads_it_or_is_a_documented_difference(readings):
    rows, _ = readings
    undocumented = {
        row.case["id"]: (row.swerl.brief(), row.whole.brief(), row.streamed.brief())
        for row in rows
        if not row.agrees and row.case["id"] not in DIFFERENCES
    }
    assert undocumented == {}, "swerl reads these replies unlike vLLM (swerl, vLLM, streamed)"
    no_longer = [row.case["id"] for row in rows if row.agrees and row.case["id"] in DIFFERENCES]
    assert no_longer == [], "documented as differences, these now agree: drop them"


@pytest.mark.vllm
def test_the_well_formed_calls_read_the_same_in_both(readings):
    rows, _ = readings
    by_id = {row.case["id"]: row for row in rows}
    for case_id in (
        "hermes-every-json-type",
        "coder-every-json-type",
        "coder-multiline-file-contents",
    ):
        row = by_id[case_id]
        assert row.agrees, case_id
        assert row.swerl.calls and row.swerl.calls == row.whole.calls


@pytest.mark.vllm
def test_the_table_in_the_docs_is_the_one_the_parsers_write(readings):
    rows, version = readings
    assert TABLE_PATH.read_text() == render_table(rows, version), "run scripts/parity-table"


def test_the_corpus_covers_both_syntaxes_and_names_only_known_parsers():
    corpus = load_cases()
    ids = [case["id"] for case in corpus["cases"]]
    assert len(ids) == len(set(ids))
    assert set(DIFFERENCES) <= set(ids), "a documented difference names no case"
    assert {case["tool_call_parser"] for case in corpus["cases"]} == set(SWERL_TOOL_PARSER)
    assert {case["reasoning_parser"] for case in corpus["cases"]} == set(SWERL_REASONING_PARSER)
