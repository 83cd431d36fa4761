"""The exec servicer's enum tables cover every value of their pb enum and of the domain's side,
so a value added to either fails here rather than at run time on some later call."""

from __future__ import annotations

from swerl.exec import servicer
from swerl.exec.image_ensure import PULL_RESULTS
from swerl.exec.output import STDERR, STDOUT
from swerl.exec.sandboxes import NETWORK_MODES
from swerl.exec.shell import SIGNALS
from swerl.exec.v1 import sandbox_pb2 as pb


def _values(enum) -> set[int]:
    return set(enum.values())


def _specified(enum) -> set[int]:
    return {number for name, number in enum.items() if not name.endswith("_UNSPECIFIED")}


def test_tables_read_from_requests_cover_every_value_of_their_enum():
    assert set(servicer.NETWORK_TO_DOMAIN) == _values(pb.NetworkMode)
    assert set(servicer.SESSION_OF_MODE) == _values(pb.ExecMode)
    # An unspecified signal is ignored, so that table leaves it out on purpose.
    assert set(servicer.SIGNAL_TO_DOMAIN) == _specified(pb.Signal)


def test_tables_read_from_requests_land_on_domain_values():
    assert set(servicer.NETWORK_TO_DOMAIN.values()) == set(NETWORK_MODES)
    assert set(servicer.SIGNAL_TO_DOMAIN.values()) == set(SIGNALS)
    assert servicer.SESSION_OF_MODE[pb.EXEC_MODE_SESSION] is True
    assert servicer.SESSION_OF_MODE[pb.EXEC_MODE_ISOLATED] is False


def test_tables_written_to_responses_cover_every_domain_value_and_specified_pb_value():
    cases = [
        (servicer.NETWORK_TO_PB, set(NETWORK_MODES), pb.NetworkMode),
        (servicer.OUTPUT_STREAM_TO_PB, {STDOUT, STDERR}, pb.OutputStream),
        (servicer.SANDBOX_STATE_TO_PB, {True, False}, pb.SandboxState),
        (servicer.PULL_STATUS_TO_PB, set(PULL_RESULTS), pb.ImagePullStatus),
    ]
    for table, domain, enum in cases:
        assert set(table) == domain, enum.DESCRIPTOR.name
        # One pb value per domain value, none of them UNSPECIFIED, and every one reachable.
        assert sorted(table.values()) == sorted(_specified(enum)), enum.DESCRIPTOR.name
