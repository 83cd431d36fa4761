"""The pool's explicit enum tables cover both sides: every domain value has a contract value and
every contract value but UNSPECIFIED has a domain value, so a value added on either side fails
here, not on the first request that carries it."""

from __future__ import annotations

import pytest

from swerl.pool import client, servicer
from swerl.pool.leases import PREFETCH_STATUSES
from swerl.pool.model import LeaseState, LossReason, NodeState
from swerl.pool.v1 import pool_pb2 as pb

TABLES = [
    (LeaseState, pb.LeaseState, "LEASE_STATE_", servicer.LEASE_STATE_TO_PB),
    (LossReason, pb.LeaseLossReason, "LEASE_LOSS_REASON_", servicer.LOSS_REASON_TO_PB),
    (NodeState, pb.NodeState, "NODE_STATE_", servicer.NODE_STATE_TO_PB),
]


def specified(pb_enum) -> set[int]:
    return {value for name, value in pb_enum.items() if not name.endswith("_UNSPECIFIED")}


@pytest.mark.parametrize(("domain", "pb_enum", "prefix", "to_pb"), TABLES)
def test_every_domain_value_maps_to_the_contract_value_of_its_name(domain, pb_enum, prefix, to_pb):
    assert set(to_pb) == set(domain)
    for value, number in to_pb.items():
        assert pb_enum.Name(number) == prefix + value.value


@pytest.mark.parametrize(("domain", "pb_enum", "prefix", "to_pb"), TABLES)
def test_every_specified_contract_value_has_exactly_one_domain_value(
    domain, pb_enum, prefix, to_pb
):
    assert sorted(to_pb.values()) == sorted(specified(pb_enum))


def test_tables_read_back_what_they_write():
    for to_pb, from_pb in (
        (servicer.LEASE_STATE_TO_PB, servicer.LEASE_STATE_FROM_PB),
        (servicer.NODE_STATE_TO_PB, servicer.NODE_STATE_FROM_PB),
    ):
        assert {from_pb[number]: number for number in to_pb.values()} == to_pb


def test_client_names_every_loss_reason_as_the_pool_does():
    assert set(client.LOSS_REASON_NAMES) == set(pb.LeaseLossReason.values())
    for value, number in servicer.LOSS_REASON_TO_PB.items():
        assert client.LOSS_REASON_NAMES[number] == value
    assert client.LOSS_REASON_NAMES[pb.LEASE_LOSS_REASON_UNSPECIFIED] == "UNSPECIFIED"


def test_domain_states_print_as_their_names():
    # Metric labels and log fields carry these: "ACTIVE", never "LeaseState.ACTIVE".
    for value in [*LeaseState, *LossReason, *NodeState]:
        assert str(value) == f"{value}" == value.value


def test_prefetch_statuses_map_to_the_contract_value_of_their_name():
    # Every status the pool's prefetch can report has a contract value, every specified
    # contract value has a status, and no two rows are swapped.
    assert set(servicer.PREFETCH_STATUS_TO_PB) == set(PREFETCH_STATUSES)
    assert sorted(servicer.PREFETCH_STATUS_TO_PB.values()) == sorted(specified(pb.PrefetchStatus))
    for value, number in servicer.PREFETCH_STATUS_TO_PB.items():
        assert pb.PrefetchStatus.Name(number) == "PREFETCH_STATUS_" + value
