"""A command sent to a node whose connection broke under the send is told UNAVAILABLE, as the
same call a moment later is: gRPC's asyncio stream ends such a call INTERNAL "Internal error
from Core" (its failed `execute_batch` of the send) when the send loses the race with the
connection's own status (seen with a SIGSTOPped node, tests/exec/test_node_stopped.py)."""

from __future__ import annotations

import grpc

from swerl.exec.client import send_failure

SEND_FAILED = (
    'Failed "execute_batch": (<grpc._cython.cygrpc.SendMessageOperation object at 0x7f1f>,)'
)


def _error(code: grpc.StatusCode, details: str, debug: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, debug)


def test_a_send_that_failed_in_the_transport_is_unavailable() -> None:
    told = send_failure(_error(grpc.StatusCode.INTERNAL, "Internal error from Core", SEND_FAILED))
    assert told.code() is grpc.StatusCode.UNAVAILABLE
    assert told.details() == (
        "the connection to the node failed while the request was sent"
        " (gRPC: Internal error from Core)"
    )


def test_other_errors_of_a_send_stay_what_they_are() -> None:
    internal = _error(grpc.StatusCode.INTERNAL, "a bug on the node", "")
    assert send_failure(internal) is internal
    gone = _error(grpc.StatusCode.UNAVAILABLE, "ping timeout", SEND_FAILED)
    assert send_failure(gone) is gone
