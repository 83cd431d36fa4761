"""The dashboard's node table shows each node's image disk budget where the node has one."""

from __future__ import annotations

from swerl.web.dashboard import _budget


def test_a_node_without_a_budget_shows_a_dash():
    assert _budget(5 << 30, 0) == "-"


def test_a_budget_shows_used_over_total_in_gib():
    assert _budget(3 << 29, 300 << 30) == "1.5 / 300.0 GiB"
