"""The replay policy server against the SGLang code it stands for. SGLang needs a GPU and cannot
run here, so the replay mirrors its `/generate`; this reads the released sglang wheel's source
(downloaded from PyPI without dependencies, never imported) and fails when a line the replay and
the SGLang client cite no longer says what they rely on, or when the replay's refusals stop being
SGLang's words."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from swerl.agent.policy.clients import over_context_length
from swerl.devservers.replay import ReplayPolicyServer

SGLANG = "0.5.23"  # the version swerl/devservers/replay.py and policy.py cite
HTTP = "sglang/srt/entrypoints/http_server.py"
TM = "sglang/srt/managers/tokenizer_manager.py"
UTILS = "sglang/srt/managers/utils.py"
SCHED = "sglang/srt/managers/scheduler.py"
BATCH = "sglang/srt/managers/schedule_batch.py"

# (file, line, what the cited line holds)
CITED = [
    (HTTP, 929, '"/generate",'),
    (HTTP, 987, "return orjson_response(ret)"),
    (HTTP, 2246, "def _create_error_response(e):"),
    (HTTP, 2248, '{"error": {"message": str(e)}},'),
    (HTTP, 2249, 'status_code=getattr(e, "status_code", HTTPStatus.BAD_REQUEST),'),
    (TM, 1307, "def _validate_one_request("),
    (TM, 1338, "if input_token_num >= self.context_len:"),
    (TM, 2509, '"finish_reason": recv_obj.finished_reasons[i],'),
    (TM, 2511, '"weight_version": self.config_value("weight_version"),'),
    (TM, 2869, 'meta_info["output_token_logprobs"] = state.output_token_logprobs'),
    (TM, 3098, "def detokenize_logprob_tokens("),
    (TM, 3106, "(logprob, token_id, None)"),
    (TM, 1917, "if status_code == HTTPStatus.BAD_REQUEST:"),
    (TM, 1918, 'raise ValueError(finish_reason["message"])'),
    (UTILS, 259, "def validate_input_length("),
    (UTILS, 272, "if len(req.origin_input_ids) >= max_req_input_len:"),
    (SCHED, 3246, "error_msg = validate_input_length("),
    (SCHED, 3252, "req.set_finish_with_abort(error_msg)"),
    (BATCH, 2224, "status_code: int = HTTPStatus.BAD_REQUEST,"),
]


@pytest.fixture(scope="module")
def sglang_source(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    where = tmp_path_factory.mktemp("sglang-wheel")
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "-q", "--no-deps"),
            *(f"sglang=={SGLANG}", "-d", str(where)),
        ],
        check=True,
        timeout=600,
    )
    (wheel,) = Path(where).glob("sglang-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = (HTTP, TM, UTILS, SCHED, BATCH)
        return {name: zf.read(name).decode().splitlines() for name in names}


def test_the_lines_the_replay_cites_say_what_it_relies_on(sglang_source) -> None:
    for path, line, text in CITED:
        assert sglang_source[path][line - 1].strip() == text, f"{path}:{line} changed"


def _upstream_message(lines: list[str], first: int, last: int, **names: object) -> str:
    """The f-string literal on lines first..last (1-based) of an upstream file (a refusal's
    message), formatted with `names`."""
    expr = "(" + "\n".join(line.strip() for line in lines[first - 1 : last]) + ")"
    return str(eval(compile(expr, "tokenizer_manager", "eval"), {}, names))


def test_the_replays_context_refusals_are_sglangs_words(sglang_source) -> None:
    lines = sglang_source[TM]
    replay = ReplayPolicyServer({}, context_length=100)
    engine = SimpleNamespace(context_len=100)

    def refusal(n: int, max_new: int) -> str:
        body = {"input_ids": list(range(n)), "sampling_params": {"max_new_tokens": max_new}}
        return replay._over_context_length(json.dumps(body).encode())

    assert refusal(100, 1) == _upstream_message(lines, 1349, 1350, input_token_num=100, self=engine)
    assert refusal(60, 50) == _upstream_message(
        lines,
        1372,
        1376,
        input_token_num=60,
        max_new_tokens=50,
        total_tokens=110,
        self=engine,
    )
    assert refusal(60, 40) == ""
    # ... and the SGLang client reads both, in _create_error_response's body, as the context
    # limit.
    for message in (refusal(100, 1), refusal(60, 50)):
        assert over_context_length(json.dumps({"error": {"message": message}}).encode())


def test_the_replays_scheduler_refusal_is_sglangs_words(sglang_source) -> None:
    """Issue 41 point 3: `validate_input_length`'s message (utils.py:282-286), which the
    scheduler aborts with 400, and which the SGLang client reads as the context limit."""
    lines = sglang_source[UTILS]
    replay = ReplayPolicyServer({}, max_req_input_len=80)
    req = SimpleNamespace(origin_input_ids=list(range(80)))

    def refusal(n: int) -> str:
        body = {"input_ids": list(range(n)), "sampling_params": {"max_new_tokens": 8}}
        return replay._over_context_length(json.dumps(body).encode())

    assert refusal(80) == _upstream_message(lines, 283, 285, req=req, max_req_input_len=80)
    assert refusal(79) == ""
    assert over_context_length(json.dumps({"error": {"message": refusal(80)}}).encode())
