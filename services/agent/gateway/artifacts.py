"""A closed session on disk for `swerl inspect`: `<artifact_dir>/<owner>__<session_id>/` with
meta.json (what the inspector's list shows), session.json (the call tree, GetSessionResponse as
JSON) and tokens.json (the chains as CloseSession returned them). Written in the CPU pool.

An episode folder may hold a session.json too (a harness episode's own session): the inspector
shows the tree wherever it finds one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict

from swerl.agent.loop.artifacts import SESSION_FILE, episode_dir
from swerl.agent.v1 import agent_pb2 as pb

SESSION_KIND = "gateway-session"


def _record(record: pb.TokenRecord) -> dict[str, Any]:
    return {
        "prompt_ids": list(record.prompt_ids),
        "response_ids": list(record.response_ids),
        "loss_mask": list(record.loss_mask),
        "logprobs": [round(x, 5) for x in record.logprobs],
    }


def session_json(session: pb.GetSessionResponse) -> dict[str, Any]:
    """The tree as the inspector reads it (proto field names, every field present)."""
    return MessageToDict(
        session, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def write_session(root: str, closed: pb.CloseSessionResponse) -> Path:
    """Writes the closed session's folder under `root`; returns the folder."""
    session = closed.session
    owner = session.owner or "session"
    status = pb.SessionStatus.Name(closed.status).removeprefix("SESSION_STATUS_")
    reward = (
        closed.records[0].reward
        if closed.records and closed.records[0].HasField("reward")
        else None
    )
    meta = {
        "kind": SESSION_KIND,
        "episode_id": session.session_id,
        "instance_id": owner,
        "status": status,
        "reward": reward,
        "metrics": {"turns": len(session.calls), **dict(session.metrics)},
    }
    folder = episode_dir(root, owner, session.session_id)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SESSION_FILE).write_text(json.dumps(session_json(session), indent=1))
    tokens = {"trajectory": None, "turns": [], "chains": [_record(r) for r in closed.records]}
    (folder / "tokens.json").write_text(json.dumps(tokens, separators=(",", ":")))
    # meta.json last: a folder with it is complete (the inspector indexes folders by it).
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    return folder
