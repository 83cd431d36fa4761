"""Episode artifacts: `<dir>/<instance_id>__<episode_id>/` with traj.json (mini-swe-agent style
messages, per-step debug, info), patch.diff, meta.json, harness.log (a harness's own log, when it
keeps one), session.json (a harness episode's gateway session tree, the shape a closed session's
folder holds: `swerl inspect` shows the tree) and, when the episode has token records,
tokens.json (the records as trained, read by `swerl inspect`), written in the thread pool."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from google.protobuf.json_format import MessageToDict

from swerl.agent.v1 import agent_pb2 as pb

if TYPE_CHECKING:
    from swerl.agent.loop.episode import Episode

# The gateway session tree's file (swerl.agent.gateway.artifacts writes the same for a session).
SESSION_FILE = "session.json"

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def episode_dir(root: str, instance_id: str, episode_id: str) -> Path:
    name = f"{_UNSAFE.sub('_', instance_id)}__{_UNSAFE.sub('_', episode_id)}"
    return Path(root) / name


def _token_record(record: pb.TokenRecord) -> dict[str, Any]:
    return {
        "prompt_ids": list(record.prompt_ids),
        "response_ids": list(record.response_ids),
        "loss_mask": list(record.loss_mask),
        "logprobs": [round(x, 5) for x in record.logprobs],
    }


def _write(
    directory: Path,
    traj: dict[str, Any],
    patch: bytes,
    meta: dict[str, Any],
    result: pb.EpisodeResult,
    harness_log: bytes = b"",
    session_tree: Callable[[], dict[str, Any]] | None = None,
) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    if harness_log:
        (directory / "harness.log").write_bytes(harness_log)
    if session_tree is not None:
        # Built here, in the pool: the tree holds every call's messages.
        (directory / SESSION_FILE).write_text(json.dumps(session_tree(), indent=1))
    (directory / "traj.json").write_text(json.dumps(traj, indent=1))
    (directory / "patch.diff").write_bytes(patch)
    (directory / "meta.json").write_text(json.dumps(meta, indent=1))
    if result.HasField("trajectory") or result.turns or result.chains:
        tokens = {
            "trajectory": _token_record(result.trajectory)
            if result.HasField("trajectory")
            else None,
            "turns": [_token_record(turn) for turn in result.turns],
            # A trimmed whole trajectory: one record per chain (EpisodeResult.chains).
            "chains": [_token_record(chain) for chain in result.chains],
        }
        (directory / "tokens.json").write_text(json.dumps(tokens, separators=(",", ":")))
    return str(directory)


async def write_artifacts(
    episode: Episode, result: pb.EpisodeResult, executor: Executor | None = None
) -> str:
    spec = episode.spec
    status = pb.EpisodeStatus.Name(result.status).removeprefix("EPISODE_STATUS_")
    info = {
        "exit_status": status,
        "submission": episode.submission or "",
        "model": spec.model,
        "config": spec.config.name,
        "metrics": dict(result.metrics),
        "reward": result.reward if result.HasField("reward") else None,
        "error_reason": result.error_reason,
        "error_message": result.error_message,
    }
    traj = {
        "trajectory_format": "mini-swe-agent-1",
        "instance_id": spec.instance.instance_id,
        "episode_id": spec.episode_id,
        "messages": episode.messages,
        "steps": episode.steps,
        "info": info,
    }
    meta = {
        "episode_id": spec.episode_id,
        "instance_id": spec.instance.instance_id,
        "image": spec.instance.image_name,
        "status": status,
        "harness": spec.harness,
        "reward": info["reward"],
        "report": MessageToDict(result.report) if result.HasField("report") else None,
        "limits": {
            "max_turns": spec.max_turns,
            "max_context_tokens": spec.max_context_tokens,
            "max_new_tokens": spec.max_new_tokens,
            "wall_timeout_s": spec.wall_timeout_s,
            "command_timeout_s": spec.command_timeout_s,
        },
        "sampling_params": spec.sampling_params,
        "endpoint": spec.endpoint,
        "metrics": dict(result.metrics),
        "step_scores": [MessageToDict(s) for s in result.step_scores],
    }
    directory = episode_dir(spec.artifact_dir, spec.instance.instance_id, episode.key)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(
        executor,
        _write,
        directory,
        traj,
        bytes(result.patch),
        meta,
        result,
        episode.harness.log(),
        episode.model.tree_json if episode.model is not None else None,
    )
