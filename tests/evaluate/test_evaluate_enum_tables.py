"""The evaluator's domain values cross to the contract's enums through complete tables."""

from __future__ import annotations

import pytest

from swerl.exec import evaluate
from swerl.exec.evaluate_servicer import APPLY_METHOD_TO_PB, PHASE_TO_PB, STATUS_TO_PB
from swerl.exec.v1 import evaluate_pb2 as pb

TABLES = [
    (STATUS_TO_PB, evaluate.STATUSES, pb.EvaluationStatus),
    (PHASE_TO_PB, evaluate.PHASES, pb.EvaluationPhase),
    (APPLY_METHOD_TO_PB, evaluate.APPLY_METHODS, pb.ApplyMethod),
]


@pytest.mark.parametrize(("table", "domain", "enum"), TABLES, ids=["status", "phase", "apply"])
def test_every_domain_value_maps_to_one_distinct_enum_value(table, domain, enum):
    assert set(table) == set(domain)
    assert len(set(table.values())) == len(table)


@pytest.mark.parametrize(("table", "domain", "enum"), TABLES, ids=["status", "phase", "apply"])
def test_every_enum_value_but_unspecified_is_reached_by_the_table(table, domain, enum):
    specified = {number for name, number in enum.items() if not name.endswith("_UNSPECIFIED")}
    assert set(table.values()) == specified


@pytest.mark.parametrize(("table", "domain", "enum"), TABLES, ids=["status", "phase", "apply"])
def test_each_domain_value_maps_to_the_enum_value_of_the_same_name(table, domain, enum):
    # Guards against two rows swapped in a table, which completeness alone would not catch.
    for value, number in table.items():
        assert enum.Name(number).endswith("_" + value)
