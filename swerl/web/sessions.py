"""A gateway session's call tree for the inspector, from session.json (GetSessionResponse as
JSON): the calls in tree order with their depth, which call each one extended, where a branch
forked and why, and which chain (trained sample) each leaf ends. Nothing here knows HTTP."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_KIND = {
    "SESSION_CALL_KIND_ROOT": "root",
    "SESSION_CALL_KIND_EXTEND": "extend",
    "SESSION_CALL_KIND_FORK": "fork",
}


@dataclass
class CallRow:
    index: int
    parent: int | None
    kind: str  # root | extend | fork
    depth: int  # indentation: a chain's calls share one, a fork is one deeper than its parent
    protocol: str
    prompt_tokens: int
    reused_tokens: int
    sampled_tokens: int
    tool_calls: int
    finish_reason: str
    request_messages: int
    rendered_messages: int
    why: str
    chain: int | None = None  # the chain (tokens.json "chains" index) this leaf ends
    children: list[int] = field(default_factory=list)


@dataclass
class SessionTree:
    session_id: str
    status: str
    owner: str
    rows: list[CallRow]  # depth-first, children in call order
    chains: int
    metrics: dict[str, float]
    infra_errors: int
    context_errors: int


def _int(call: dict[str, Any], name: str) -> int:
    try:
        return int(call.get(name) or 0)
    except (TypeError, ValueError):
        return 0


def _why(row: CallRow, rows: dict[int, CallRow], first_root: int) -> str:
    if row.kind == "root":
        if row.index == first_root:
            return "first call of the session"
        return (
            "new root: the request continues no recorded reply (a sub-agent's own "
            "conversation, or a history rewritten from its start)"
        )
    parent = rows[row.parent] if row.parent is not None else None
    kept = row.request_messages - row.rendered_messages
    if row.kind == "extend":
        return f"extends call {row.parent}: {row.rendered_messages} new message(s) rendered"
    before = [c for c in (parent.children if parent else []) if c < row.index]
    earlier = f"call {before[0]}" if before else "an earlier call"
    return (
        f"fork at call {row.parent}: its reply was already continued by {earlier}; this "
        f"request kept the first {kept} message(s) and rewrote what followed "
        "(compaction, a retried turn, or a sub-agent started from there)"
    )


def session_tree(data: Any) -> SessionTree | None:
    """The view of one session.json; None when it is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("calls"), list):
        return None
    rows: dict[int, CallRow] = {}
    for call in data["calls"]:
        if not isinstance(call, dict):
            continue
        index = _int(call, "call_index")
        parent = call.get("parent_call_index")
        rows[index] = CallRow(
            index=index,
            parent=int(parent) if isinstance(parent, int | float | str) and parent != "" else None,
            kind=_KIND.get(str(call.get("kind", "")), "root"),
            depth=0,
            protocol=str(call.get("protocol", "")),
            prompt_tokens=_int(call, "prompt_tokens"),
            reused_tokens=_int(call, "reused_tokens"),
            sampled_tokens=_int(call, "sampled_tokens"),
            tool_calls=_int(call, "tool_calls"),
            finish_reason=str(call.get("finish_reason", "")),
            request_messages=_int(call, "request_messages"),
            rendered_messages=_int(call, "rendered_messages"),
            why="",
        )
    for row in rows.values():
        if row.parent is not None and row.parent not in rows:
            row.parent = None  # a tree cut short: show the call as a root
        if row.parent is not None:
            rows[row.parent].children.append(row.index)
    # Chains are numbered as CloseSession orders them: leaves in call order.
    leaves = sorted(i for i, r in rows.items() if not r.children)
    for chain, index in enumerate(leaves):
        rows[index].chain = chain
    roots = sorted(i for i, r in rows.items() if r.parent is None)
    first_root = roots[0] if roots else -1
    ordered: list[CallRow] = []
    stack = [(i, 0) for i in reversed(roots)]
    while stack:
        index, depth = stack.pop()
        row = rows[index]
        row.depth = depth
        row.why = _why(row, rows, first_root)
        ordered.append(row)
        # A chain goes on at its depth; a fork from it is indented one step under it.
        children = sorted(row.children)
        stack.extend((c, depth + (1 if k else 0)) for k, c in reversed(list(enumerate(children))))
    metrics = data.get("metrics") if isinstance(data.get("metrics"), dict) else {}
    return SessionTree(
        session_id=str(data.get("session_id", "")),
        status=str(data.get("status", "")).removeprefix("SESSION_STATUS_"),
        owner=str(data.get("owner", "")),
        rows=ordered,
        chains=len(leaves),
        metrics={str(k): float(v) for k, v in (metrics or {}).items()},
        infra_errors=_int(data, "infra_errors"),
        context_errors=_int(data, "context_errors"),
    )
