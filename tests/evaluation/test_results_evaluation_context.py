"""results.jsonl and summary.json say how each graded episode was graded: the evaluation's
network, its package index and the report's warnings, as the episode's meta.json holds them."""

from __future__ import annotations

import json

from google.protobuf.json_format import MessageToDict

from swerl.evaluation.results import OutputDir
from swerl.exec.v1 import evaluate_pb2, sandbox_pb2


def _episode(tmp_path, instance_id: str, report: evaluate_pb2.EvaluationReport | None) -> dict:
    """A record as the runner writes it, beside a meta.json as the agent's artifacts write it."""
    artifact_dir = tmp_path / "artifacts" / f"{instance_id}__ep"
    artifact_dir.mkdir(parents=True)
    meta = {"instance_id": instance_id, "report": MessageToDict(report) if report else None}
    (artifact_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    return {
        "instance_id": instance_id,
        "status": "SUBMITTED",
        "eval_status": "UNRESOLVED" if report else "",
        "resolved": False,
        "patch": "diff",
        "artifact_dir": str(artifact_dir),
    }


def test_records_and_summary_carry_the_evaluation_network_and_warnings(tmp_path):
    offline = evaluate_pb2.EvaluationReport(
        status=evaluate_pb2.EVALUATION_STATUS_UNRESOLVED,
        network=sandbox_pb2.NETWORK_MODE_NONE,
        warnings=[
            evaluate_pb2.EvaluationWarning(
                reason="NETWORK_STEP_FAILED", message="+ pip install -e .: Could not resolve host"
            ),
            evaluate_pb2.EvaluationWarning(reason="INSTALL_STEP_FAILED", message="ERROR: ..."),
        ],
    )
    online = evaluate_pb2.EvaluationReport(
        status=evaluate_pb2.EVALUATION_STATUS_RESOLVED_FULL,
        network=sandbox_pb2.NETWORK_MODE_BRIDGE,
        package_index="http://mirror.local/simple",
    )
    unset = evaluate_pb2.EvaluationReport(status=evaluate_pb2.EVALUATION_STATUS_UNRESOLVED)
    out = OutputDir(tmp_path)
    out.append(_episode(tmp_path, "offline", offline))
    out.append({**_episode(tmp_path, "online", online), "resolved": True})
    out.append(_episode(tmp_path, "unset", unset))
    out.append(_episode(tmp_path, "ungraded", None))

    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    by_id = {line["instance_id"]: line for line in lines}
    assert by_id["offline"]["eval_network"] == "NONE"
    assert by_id["offline"]["eval_package_index"] == ""
    assert by_id["offline"]["eval_warnings"] == [
        {"reason": "NETWORK_STEP_FAILED", "message": "+ pip install -e .: Could not resolve host"},
        {"reason": "INSTALL_STEP_FAILED", "message": "ERROR: ..."},
    ]
    assert by_id["online"]["eval_network"] == "BRIDGE"
    assert by_id["online"]["eval_package_index"] == "http://mirror.local/simple"
    assert by_id["online"]["eval_warnings"] == []
    assert by_id["unset"]["eval_network"] == "NONE"  # UNSPECIFIED is treated as NONE
    assert "eval_network" not in by_id["ungraded"]  # not graded: nothing to say

    summary = out.write_derived(["offline", "online", "unset", "ungraded"], "m", {})
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == summary
    assert summary["by_eval_network"] == {"BRIDGE": 1, "NONE": 2}
    assert summary["by_eval_package_index"] == {"http://mirror.local/simple": 1}
    assert summary["eval_warnings_by_reason"] == {
        "INSTALL_STEP_FAILED": 1,
        "NETWORK_STEP_FAILED": 1,
    }
    assert summary["instances_with_eval_warnings"] == ["offline"]


def test_a_record_written_before_the_fields_existed_gets_them_in_the_summary(tmp_path):
    report = evaluate_pb2.EvaluationReport(
        status=evaluate_pb2.EVALUATION_STATUS_UNRESOLVED, network=sandbox_pb2.NETWORK_MODE_BRIDGE
    )
    record = _episode(tmp_path, "old", report)
    (tmp_path / "results.jsonl").write_text(json.dumps(record) + "\n")  # as an older swerl wrote
    summary = OutputDir(tmp_path).write_derived(["old"], "m", {})
    assert summary["by_eval_network"] == {"BRIDGE": 1}


def test_artifacts_not_readable_here_leave_the_record_as_it_was(tmp_path):
    out = OutputDir(tmp_path)
    record = {
        "instance_id": "remote",
        "status": "SUBMITTED",
        "eval_status": "RESOLVED_FULL",
        "resolved": True,
        "artifact_dir": "/nonexistent/remote-agent-host/remote__ep",
    }
    out.append(record)
    assert out.records()["remote"] == record
    assert out.write_derived(["remote"], "m", {})["by_eval_network"] == {}
