"""configure_logging: JSON or console, bound context on every line, stdlib records included."""

from __future__ import annotations

import json
import logging

import pytest
import structlog

from swerl.chassis.logging import configure_logging
from swerl.exec.v1 import sandbox_pb2


@pytest.fixture(autouse=True)
def _restore_logging():
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    root.handlers[:] = handlers
    root.setLevel(level)


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_json_format_writes_one_object_per_line_with_bound_context(capsys):
    configure_logging("json", "info")
    structlog.contextvars.bind_contextvars(request_id="req-7")

    structlog.get_logger().info("lease.expired", lease_id="l-1", ttl_s=30)

    (line,) = _json_lines(capsys.readouterr().err)
    assert line["event"] == "lease.expired"
    assert line["request_id"] == "req-7"
    assert (line["lease_id"], line["ttl_s"], line["level"]) == ("l-1", 30, "info")
    assert "timestamp" in line


def test_stdlib_records_are_rendered_as_json_too(capsys):
    configure_logging("json", "info")

    logging.getLogger("grpc.something").warning("core said %s", "hello")

    (line,) = _json_lines(capsys.readouterr().err)
    assert (line["event"], line["level"], line["logger"]) == (
        "core said hello",
        "warning",
        "grpc.something",
    )


def test_exceptions_are_a_string_field_in_json(capsys):
    configure_logging("json", "info")

    try:
        raise ValueError("boom")
    except ValueError:
        structlog.get_logger().exception("task.failed")

    (line,) = _json_lines(capsys.readouterr().err)
    assert "ValueError: boom" in line["exception"]


def test_lines_below_the_level_are_dropped(capsys):
    configure_logging("json", "warning")

    structlog.get_logger().info("quiet.event")
    structlog.get_logger().warning("loud.event")

    assert [line["event"] for line in _json_lines(capsys.readouterr().err)] == ["loud.event"]


def test_console_format_is_human_readable_not_json(capsys):
    configure_logging("console", "info")

    structlog.get_logger().info("server.started", port=5000)

    err = capsys.readouterr().err
    assert "server.started" in err and "port=5000" in err
    assert not err.lstrip().startswith("{")


def test_configuring_twice_keeps_a_single_handler(capsys):
    configure_logging("json", "info")
    configure_logging("json", "info")

    structlog.get_logger().info("once")

    assert len(_json_lines(capsys.readouterr().err)) == 1


async def test_handler_logs_carry_the_request_id_and_method_of_their_rpc(stub, capsys):
    configure_logging("json", "info")

    await stub.GetNodeInfo(
        sandbox_pb2.GetNodeInfoRequest(), metadata=(("x-request-id", "req-ctx"),), timeout=5
    )

    lines = _json_lines(capsys.readouterr().err)
    (handler_line,) = [line for line in lines if line["event"] == "node.info_requested"]
    (rpc_line,) = [line for line in lines if line["event"] == "rpc"]
    assert handler_line["request_id"] == rpc_line["request_id"] == "req-ctx"
    assert handler_line["method"] == "/swerl.exec.v1.SandboxService/GetNodeInfo"
    assert isinstance(rpc_line["duration_ms"], float)


def test_records_go_to_the_stderr_of_their_time_not_one_closed_since(monkeypatch):
    # An embedding process (pytest's capture between tests) replaces and closes sys.stderr
    # after logging was configured: records must reach the current one, with no logging error.
    import io

    first = io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    configure_logging("json", "info")
    first.close()
    second = io.StringIO()
    monkeypatch.setattr("sys.stderr", second)
    errors: list[BaseException] = []
    monkeypatch.setattr(logging.Handler, "handleError", lambda self, record: errors.append(record))

    structlog.get_logger().warning("pool.away_renewing_on_nodes", leases=1)

    assert errors == []
    (line,) = _json_lines(second.getvalue())
    assert line["event"] == "pool.away_renewing_on_nodes"
