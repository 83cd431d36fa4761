"""Reading votes, tallying them, and seeding them: pure functions, no servers."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swerl.prm.votes import JudgeState, Vote, parse_verdict, tally, vote_seed


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("The step finds the bug.\n\\boxed{+1}", 1),
        ("The command failed.\n\\boxed{-1}", -1),
        ("\\boxed{ +1 }", 1),
        ("\\boxed{1}", 1),
        ("$\\boxed{-1}$", -1),
        ("\\boxed{$-1$}", -1),
        ("\\boxed{\u22121}", -1),
    ],
)
def test_well_formed_verdicts_are_read(text, value):
    assert parse_verdict(text) == value


@pytest.mark.parametrize(
    "text",
    [
        "\\boxed{+1",  # never closed
        "\\boxed{}",
        "\\boxed{yes}",
        "\\boxed{+2}",
        "\\boxed{10}",
        "\\boxed{-1.0}",
        "boxed{+1}",  # no backslash
        "\\box{+1}",
        "+1",
        "",
    ],
)
def test_malformed_verdicts_are_invalid(text):
    assert parse_verdict(text) == 0


def test_text_without_any_box_is_invalid():
    assert parse_verdict("I think this step is fine and moves things forward.") == 0


def test_the_first_of_several_verdicts_is_the_vote():
    assert parse_verdict("\\boxed{-1}\nOn second thought: \\boxed{+1}") == -1
    assert parse_verdict("\\boxed{+1} \\boxed{-1} \\boxed{-1}") == 1


def test_a_box_that_is_not_a_verdict_does_not_hide_the_verdict_after_it():
    assert parse_verdict("Score: \\boxed{maybe}. Final: \\boxed{-1}") == -1


def test_verdicts_quoted_in_the_reasoning_are_skipped():
    text = "<think>Is it \\boxed{+1} or \\boxed{-1}? It repeats a failed grep.</think>\\boxed{-1}"
    assert parse_verdict(text) == -1


def test_reasoning_cut_off_before_it_closed_leaves_no_vote():
    assert parse_verdict("<think>Probably \\boxed{+1} because") == 0


@given(st.text().filter(lambda t: "boxed" not in t))
def test_text_without_the_word_boxed_never_yields_a_vote(text):
    assert parse_verdict(text) == 0


def _vote(value: int, seed: int = 0, error: str = "") -> Vote:
    return Vote(seed=seed, text="" if error else f"\\boxed{{{value}}}", value=value, error=error)


def test_score_is_the_mean_of_the_valid_votes_only():
    verdict = tally([_vote(1, 1), _vote(0, 2), _vote(-1, 3), _vote(1, 4)])

    assert verdict.state is JudgeState.SCORED
    assert verdict.valid_votes == 3
    assert verdict.score == pytest.approx(1 / 3)


def test_all_invalid_votes_is_a_state_of_its_own_not_a_zero_score():
    verdict = tally([_vote(0, 1), _vote(0, 2), _vote(0, 3)])

    assert verdict.state is JudgeState.NO_VALID_VOTES
    assert verdict.valid_votes == 0
    assert verdict.error_message == ""


def test_votes_that_all_failed_make_a_failed_judgment_with_the_cause():
    verdict = tally([_vote(0, 1, error="timed out"), _vote(0, 2, error="timed out")])

    assert verdict.state is JudgeState.FAILED
    assert verdict.error_message == "timed out"


def test_failed_votes_count_as_invalid_when_others_answered():
    verdict = tally([_vote(0, 1, error="timed out"), _vote(-1, 2), _vote(-1, 3)])

    assert verdict.state is JudgeState.SCORED
    assert verdict.score == -1.0
    assert verdict.valid_votes == 2


def test_seeds_are_distinct_for_every_episode_step_and_vote():
    episodes = [f"ep-{i}" for i in range(20)]
    keys = list(itertools.product(episodes, range(50), range(5)))
    seeds = {vote_seed(0, e, s, v) for e, s, v in keys}

    assert len(seeds) == len(keys)
    assert all(0 <= seed < 2**63 for seed in seeds)


def test_seeds_are_deterministic_and_follow_the_base_seed():
    assert vote_seed(7, "ep", 3, 1) == vote_seed(7, "ep", 3, 1)
    assert vote_seed(7, "ep", 3, 1) != vote_seed(8, "ep", 3, 1)


def test_the_steps_of_an_episode_never_reuse_each_others_seeds():
    # The predecessor sampled seed + vote for every step: step 1 repeated step 0's votes.
    step0 = {vote_seed(0, "ep", 0, v) for v in range(3)}
    step1 = {vote_seed(0, "ep", 1, v) for v in range(3)}
    assert not step0 & step1
