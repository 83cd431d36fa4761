"""`swerl inspect PATH`: the trajectory inspector over a finished run, read-only.

Pages: `/` the episode list (filter, sort, search, paged), `/episode/{key}` one episode (problem,
turns, patch, evaluation report), `/episode/{key}/tokens` the token view as trained.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from aiohttp import web

from swerl.web.render import plotly_js_path, render
from swerl.web.runs import SORT_KEYS, EpisodeNotFound, Run, token_spans

RUN = web.AppKey("run", Run)
DECODE = web.AppKey("decode", object)
PER_PAGE = 50


def tokenizer_decoder(tokenizer_dir: str | None) -> Callable[[int], str] | None:
    """One token id to its text with the policy's tokenizer; None when there is none."""
    if not tokenizer_dir:
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))

    @lru_cache(maxsize=65536)
    def decode(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return decode


def _int_arg(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name, "")
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be a whole number, not {raw!r}") from None


async def episode_list(request: web.Request) -> web.Response:
    run = request.app[RUN]
    q = request.query
    sort = q.get("sort") or "instance"
    if sort not in SORT_KEYS:
        raise web.HTTPBadRequest(text=f"unknown sort {sort!r}; one of {', '.join(SORT_KEYS)}")
    reward = q.get("reward", "")
    if reward and reward != "none":
        try:
            float(reward)
        except ValueError:
            raise web.HTTPBadRequest(
                text=f"reward must be a number or 'none', not {reward!r}"
            ) from None
    started = time.perf_counter()
    page = run.query(
        status=q.get("status", ""),
        reward=reward,
        instance=q.get("instance", ""),
        search=q.get("q", ""),
        sort=sort,
        descending=q.get("order") == "desc",
        page=_int_arg(request, "page", 1),
        per_page=_int_arg(request, "per_page", PER_PAGE),
    )
    filters = {k: q.get(k, "") for k in ("status", "reward", "instance", "q", "sort", "order")}
    response = render(
        "list.html.j2",
        run=run,
        page=page,
        filters=filters,
        sort_keys=SORT_KEYS,
        per_page=_int_arg(request, "per_page", PER_PAGE),
    )
    response.headers["Server-Timing"] = f"app;dur={(time.perf_counter() - started) * 1000:.1f}"
    return response


def _episode_key(request: web.Request) -> str:
    key = request.match_info["key"]
    try:
        request.app[RUN].episode(key)
    except EpisodeNotFound:
        raise web.HTTPNotFound(text=f"no episode {key!r} in this run") from None
    return key


async def episode_page(request: web.Request) -> web.Response:
    key = _episode_key(request)
    return render("episode.html.j2", run=request.app[RUN], **request.app[RUN].detail(key))


def _trim_points(turns: list[dict[str, Any]]) -> list[bool]:
    """Per dynamic-history turn: whether its prompt dropped part of the previous turn's context
    (the prompt is not an extension of the previous prompt + response)."""
    trimmed = [False] if turns else []
    for before, now in itertools.pairwise(turns):
        previous = before["prompt_ids"] + before["response_ids"]
        trimmed.append(now["prompt_ids"][: len(previous)] != previous)
    return trimmed


async def token_page(request: web.Request) -> web.Response:
    key = _episode_key(request)
    run = request.app[RUN]
    summary = run.episode(key)
    tokens = run.tokens(key)
    if tokens is None:
        raise web.HTTPNotFound(text=f"episode {key!r} has no token records (tokens.json)")
    decoder: Any = request.app[DECODE]
    decode: Callable[[int], str] = decoder if decoder is not None else (lambda t: f"⟨{t}⟩")
    detail = run.detail(key)
    trimmed_turns = {t["turn"] for t in detail["turns"] if t.get("context_trimmed")}
    records = []
    if tokens.get("trajectory"):
        record = tokens["trajectory"]
        records.append(
            {
                "title": "Whole episode (one record)",
                **_split(record, decode),
                "trimmed": False,
                "trimmed_turns": trimmed_turns,
                "counts": _counts(record),
            }
        )
    first_turn = 0  # the episode's turn number of each chain's first policy turn
    session = detail["session"] if detail["is_session"] else None
    ends = {row.chain: row.index for row in session.rows} if session else {}
    for i, record in enumerate(tokens.get("chains") or []):
        parts = _split(record, decode, turn_offset=first_turn)
        title = f"Chain {i} (trained as one sample; a trim starts the next)"
        if session is not None:
            title = f"Chain {i} (trained as one sample; ends at call {ends.get(i, '?')})"
        records.append(
            {
                "title": title,
                **parts,
                "trimmed": False,
                # a chain after the first starts where the context was trimmed: its first turn
                # (a session's chains start at a fork or a new root instead: no trim)
                "trimmed_turns": {first_turn} if i > 0 and session is None else set(),
                "counts": _counts(record),
            }
        )
        first_turn += sum(1 for span in parts["response_spans"] if span.turn_start)
    turns = tokens.get("turns") or []
    for i, (record, trimmed) in enumerate(zip(turns, _trim_points(turns), strict=True)):
        records.append(
            {
                "title": f"Turn {i} (dynamic history)",
                **_split(record, decode),
                "trimmed": trimmed or i in trimmed_turns,
                "trimmed_turns": set(),
                "counts": _counts(record),
            }
        )
    return render(
        "tokens.html.j2",
        run=run,
        summary=summary,
        records=records,
        decoded=decoder is not None,
    )


def _split(
    record: dict[str, Any], decode: Callable[[int], str], *, turn_offset: int = 0
) -> dict[str, Any]:
    spans = token_spans(record, decode)
    if turn_offset:
        spans = [
            dataclasses.replace(s, turn=s.turn + turn_offset) if s.turn >= 0 else s for s in spans
        ]
    cut = len(record["prompt_ids"])
    return {"prompt_spans": spans[:cut], "response_spans": spans[cut:]}


def _counts(record: dict[str, Any]) -> dict[str, int]:
    trained = sum(1 for m in record.get("loss_mask") or [] if m)
    return {
        "prompt": len(record["prompt_ids"]),
        "response": len(record["response_ids"]),
        "trained": trained,
        "observation": len(record["response_ids"]) - trained,
    }


async def plotly_js(request: web.Request) -> web.FileResponse:
    return web.FileResponse(plotly_js_path(), headers={"Cache-Control": "max-age=3600"})


def make_app(run: Run, decode: Callable[[int], str] | None) -> web.Application:
    app = web.Application()
    app[RUN] = run
    app[DECODE] = decode
    app.router.add_get("/", episode_list)
    app.router.add_get("/episode/{key}", episode_page)
    app.router.add_get("/episode/{key}/tokens", token_page)
    app.router.add_get("/static/plotly.min.js", plotly_js)
    return app
