"""The PRM servicer's judge-state table covers both sides: every domain JudgeState has a contract
value and every contract value but UNSPECIFIED has a domain state, so a state added on either
side fails here, not on the first JudgeStep that returns it."""

from __future__ import annotations

from swerl.prm.servicer import STATE_TO_PB
from swerl.prm.v1 import prm_pb2 as pb
from swerl.prm.votes import JudgeState


def test_every_judge_state_maps_to_the_contract_value_of_its_name():
    assert set(STATE_TO_PB) == set(JudgeState)
    for state, number in STATE_TO_PB.items():
        assert pb.JudgeState.Name(number) == "JUDGE_STATE_" + state.value


def test_every_specified_contract_value_has_exactly_one_judge_state():
    specified = {n for name, n in pb.JudgeState.items() if not name.endswith("_UNSPECIFIED")}
    assert sorted(STATE_TO_PB.values()) == sorted(specified)
