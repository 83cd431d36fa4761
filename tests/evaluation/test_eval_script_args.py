"""`swerl eval --script`: what the forcing proxy adds to a generate request (no engine needed),
and each argument combination it cannot run refused with exit code 2 and one line, before any
stack starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from swerl.chassis.hf import bundled_qwen3_tokenizer_dir, load_tokenizer
from swerl.devservers.forcing import ForcingProxy, token_grammar
from swerl.devservers.replay import ASSISTANT_HEADER, scripts_for_tasks
from swerl.tasks import default_tasks_dir, load_tasks

TASKS = default_tasks_dir()


def _eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swerl.cli", "eval", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--policy-url", "http://127.0.0.1:9", "--script", "gold"],
            "--script needs --policy-api vllm (its structured outputs force the turns)",
        ),
        (
            ["--policy-api", "vllm", "--replay", "gold", "--script", "gold"],
            "--script forces a real engine; --replay is the in-process stand-in, not both",
        ),
        (
            ["--policy-api", "vllm", "--policy-url", "http://x:1", "--script", "gold",
             "--agent", "127.0.0.1:9"],
            "--script needs the agent in this process (--agent sends it elsewhere)",
        ),
        (
            ["--policy-api", "vllm", "--policy-url", "http://x:1", "--script", "gold",
             "--harness", "mini-swe-agent"],
            "--script plays swerl's own loop's scripts, not a --harness",
        ),
    ],
)  # fmt: skip
def test_a_script_run_it_cannot_do_is_refused_before_anything_starts(
    tmp_path, argv: list[str], message: str
) -> None:
    done = _eval(str(TASKS), "-o", str(tmp_path / "out"), *argv)
    assert done.returncode == 2
    assert done.stderr.strip() == f"swerl eval: {message}"
    assert not (tmp_path / "out").exists()


def test_a_script_needs_a_tasks_directory(tmp_path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("{}\n")
    done = _eval(
        str(rows), "-o", str(tmp_path / "out"), "--policy-api", "vllm",
        "--policy-url", "http://x:1", "--script", "gold",
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == "swerl eval: --script plays scripts of a tasks directory"


def test_an_unknown_forcing_is_refused_by_the_parser(tmp_path) -> None:
    done = _eval(str(TASKS), "-o", str(tmp_path / "o"), "--script", "gold", "--forcing", "bytes")
    assert done.returncode == 2
    assert "argument --forcing: invalid choice: 'bytes'" in done.stderr


def test_the_proxy_refuses_an_unknown_forcing() -> None:
    with pytest.raises(ValueError, match="unknown forcing 'bytes'; one of text, tokens"):
        ForcingProxy("http://x:1", {}, forcing="bytes")


def _prompt(tokenizer, problem: str, assistant_turns: list[str]) -> list[int]:
    text = f"<|im_start|>user\n{problem}<|im_end|>\n"
    for turn in assistant_turns:
        text += f"{ASSISTANT_HEADER}\n{turn}<|im_end|>\n<|im_start|>user\nok<|im_end|>\n"
    text += f"{ASSISTANT_HEADER}\n"
    return tokenizer.encode(text, add_special_tokens=False)


def _request(ids: list[int]) -> bytes:
    params = {"temperature": 1.0, "max_tokens": 64, "logprobs": 0}
    return json.dumps({"request_id": "r", "token_ids": ids, "sampling_params": params}).encode()


def test_each_turn_is_forced_as_its_token_ids_or_its_text() -> None:
    task = load_tasks(TASKS)[0]
    scripts = scripts_for_tasks([task], "gold")
    [gold] = scripts.values()
    tokenizer = load_tokenizer(bundled_qwen3_tokenizer_dir())
    problem = task.instance["problem_statement"]
    by_tokens = ForcingProxy("http://x:1", scripts, forcing="tokens")
    by_text = ForcingProxy("http://x:1", scripts)
    for turn in range(len(gold)):
        ids = _prompt(tokenizer, problem, gold[:turn])
        sent, call = by_tokens.constrain(_request(ids))
        params = json.loads(sent)["sampling_params"]
        canonical = tokenizer.encode(gold[turn], add_special_tokens=False)
        assert params == {
            "temperature": 1.0,
            "max_tokens": 64,
            "logprobs": 0,
            "structured_outputs": {"grammar": token_grammar(canonical)},
        }
        assert (call.turn, json.loads(sent)["token_ids"]) == (turn, ids)
        sent, _ = by_text.constrain(_request(ids))
        assert json.loads(sent)["sampling_params"]["structured_outputs"] == {"choice": [gold[turn]]}
    assert token_grammar([5, 17]) == "start: <[5]> <[17]>"


def test_a_prompt_of_no_script_goes_to_the_engine_unforced() -> None:
    task = load_tasks(TASKS)[0]
    proxy = ForcingProxy("http://x:1", scripts_for_tasks([task], "gold"))
    tokenizer = load_tokenizer(bundled_qwen3_tokenizer_dir())
    body = _request(_prompt(tokenizer, "an unrelated problem", []))
    sent, call = proxy.constrain(body)
    assert sent == body and call.script_key is None
