"""The exec node as an operator sees it through grpcurl: reflection, health, auth and an Exec.

grpcurl is a blocking subprocess talking to a server in this test's event loop, so every call
goes through `asyncio.to_thread`; run inline, it would block the loop the server needs to answer.
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from testkit.exec import TOKEN
from testkit.grpcurl import Grpcurl, json_messages

PROTO_ROOT = Path(__file__).resolve().parents[2] / "protos"
SANDBOX_PROTO = "swerl/exec/v1/sandbox.proto"


@pytest.fixture
def grpcurl(grpcurl_bin, node) -> Grpcurl:
    return Grpcurl(grpcurl_bin, node.address)


async def test_list_shows_the_sandbox_health_and_reflection_services(grpcurl):
    services = (await grpcurl.ok("list")).split()

    assert "swerl.exec.v1.SandboxService" in services
    assert "grpc.health.v1.Health" in services
    assert "grpc.reflection.v1alpha.ServerReflection" in services


async def test_describe_shows_the_service_rpcs_and_the_exec_request_oneof(grpcurl):
    service = await grpcurl.ok("describe", "swerl.exec.v1.SandboxService")
    request = await grpcurl.ok("describe", "swerl.exec.v1.ExecRequest")

    assert "service SandboxService" in service
    for rpc in ("CreateSandbox", "Exec", "DestroySandbox", "GetNodeInfo", "EnsureImages"):
        assert f"rpc {rpc}" in service
    assert "stream .swerl.exec.v1.ExecRequest" in service
    assert "oneof kind" in request
    assert ".swerl.exec.v1.ExecStart start = 1;" in request


async def test_create_exec_destroy_round_trip_returns_the_printed_stdout(grpcurl, base_image):
    created = json_messages(
        await grpcurl.ok(
            "swerl.exec.v1.SandboxService/CreateSandbox",
            flags=("-d", json.dumps({"image": base_image, "workdir": "/tmp"})),
        )
    )
    sandbox_id = created[0]["sandbox"]["sandbox_id"]
    assert sandbox_id.startswith("sbx-")

    start = {"start": {"sandbox_id": sandbox_id, "command": "printf 'hello from grpcurl\\n'; pwd"}}
    responses = json_messages(
        await grpcurl.ok(
            "swerl.exec.v1.SandboxService/Exec", flags=("-d", "@"), stdin=json.dumps(start)
        )
    )
    stdout = b"".join(
        base64.b64decode(r["output"]["data"])
        for r in responses
        if "output" in r and r["output"].get("stream") == "OUTPUT_STREAM_STDOUT"
    )
    assert "exit" in responses[-1]
    assert stdout == b"hello from grpcurl\n/tmp\n"
    # exit_code 0 is proto3's default and so absent from grpcurl's JSON.
    assert responses[-1]["exit"].get("exit_code", 0) == 0

    destroyed = json_messages(
        await grpcurl.ok(
            "swerl.exec.v1.SandboxService/DestroySandbox",
            flags=("-d", json.dumps({"sandbox_id": sandbox_id})),
        )
    )
    assert destroyed == [{"existed": True}]


async def test_health_check_answers_serving_without_a_token(grpcurl):
    # Reflection needs the token; -reflect-header sends it on the schema lookup only, so the
    # Check call itself goes out without one.
    done = await grpcurl(
        "grpc.health.v1.Health/Check",
        flags=("-reflect-header", f"authorization: Bearer {TOKEN}"),
        token=None,
    )

    assert done.returncode == 0, done.stderr
    assert json_messages(done.stdout) == [{"status": "SERVING"}]


async def test_call_without_a_token_is_unauthenticated(grpcurl):
    # The schema comes from the .proto file, not reflection (which needs the token too), so the
    # rejected call is the SandboxService RPC itself.
    done = await grpcurl(
        "swerl.exec.v1.SandboxService/GetNodeInfo",
        flags=("-import-path", str(PROTO_ROOT), "-proto", SANDBOX_PROTO, "-format-error"),
        token=None,
    )

    assert done.returncode != 0
    status = json.loads(done.stderr)  # -format-error prints the status as JSON on stderr.
    assert status["code"] == grpc.StatusCode.UNAUTHENTICATED.value[0]
    # grpcurl cannot render google.rpc.ErrorInfo without its schema and hands over the raw bytes.
    [detail] = status["details"]
    assert detail["@type"] == "type.googleapis.com/google.rpc.ErrorInfo"
    info = error_details_pb2.ErrorInfo.FromString(base64.b64decode(detail["@value"]))
    assert info.reason == "MISSING_TOKEN"


async def test_evaluate_of_a_bundled_task_runs_through_grpcurl(grpcurl, base_image):
    from swerl.tasks import build_images, default_tasks_dir, load_task

    task = load_task(default_tasks_dir() / "swerl-examples__listutils-14")
    await asyncio.to_thread(build_images, [task], base_image=base_image, progress=lambda *_: None)
    i = task.instance
    request = {
        "instance": {
            "instance_id": i["instance_id"],
            "repo": i["repo"],
            "version": i["version"],
            "base_commit": i["base_commit"],
            "test_patch": i["test_patch"],
            "fail_to_pass": i["FAIL_TO_PASS"],
            "pass_to_pass": i["PASS_TO_PASS"],
            "eval_script": i["eval_script"],
            "log_parser": i["log_parser"],
            "image_name": task.image_name,
        },
        "patch": base64.b64encode(task.gold_patch.encode()).decode(),
        "omit_logs": True,
    }
    responses = json_messages(
        await grpcurl.ok(
            "swerl.exec.v1.EvaluateService/Evaluate",
            flags=("-d", "@"),
            stdin=json.dumps(request),
        )
    )
    report = responses[-1]["report"]
    assert report["status"] == "EVALUATION_STATUS_RESOLVED_FULL"
    assert report["apply_method"] == "APPLY_METHOD_GIT_APPLY"
    assert sorted(report["fail_to_pass"]["success"]) == sorted(i["FAIL_TO_PASS"])
