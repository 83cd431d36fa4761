"""swerl's incremental chat-template rendering against miles' own TITO tokenizers
(`miles-tito-tokenizers`): miles' mock trajectories, played through miles' tokenizer classes and
fixed Qwen3 templates, give token for token the prompts swerl's gateway and episode loop build
(testkit.tito_parity; docs/tito.md).

miles' package is not a swerl dependency: scripts/test installs it into its own directory and
sets SWERL_TITO_SITE, as it does for Ray (SWERL_RAY_SITE). There, a TITO that does not import is a
failure; unset and not importable, these tests are skipped."""

from __future__ import annotations

import os

import pytest
from testkit.tito_parity import run_tito, swerl_sessions, tito_importable

# miles' Qwen3 template rows allow appending tool and user messages only: a trajectory that
# appends a system message has no fixed template in these families (docs/tito.md).
SYSTEM_APPENDING = {
    "IntermediateSystemThinkingTrajectory",
    "IntermediateSystemTrajectory",
    "MultiRoleSequenceTrajectory",
    "RetrySystemTrajectory",
    "SimpleNoToolTrajectory",
}


@pytest.fixture(scope="module")
def families():
    site = os.environ.get("SWERL_TITO_SITE", "")
    if not tito_importable(site):
        assert not site, f"SWERL_TITO_SITE={site} is set but miles_tito_tokenizers does not import"
        pytest.skip("miles-tito-tokenizers is not importable (set SWERL_TITO_SITE to its dir)")
    return run_tito(site)["families"]


@pytest.fixture(scope="module")
def sessions(families):
    return [session for family in families for session in swerl_sessions(family)]


def test_every_family_plays_every_trajectory_its_templates_allow(families):
    assert [family["template"] for family in families] == [
        "qwen3_fixed.jinja",
        "qwen3_thinking_2507_and_next_fixed.jinja",
        "qwen3.5_fixed.jinja",
    ]
    for family in families:
        assert set(family["unsupported"]) == SYSTEM_APPENDING, family["tokenizer"]
        assert len(family["trajectories"]) == 12
        assert sum(len(t["turns"]) > 1 for t in family["trajectories"]) >= 6


def test_the_gateway_renders_every_prompt_as_tito_merges_it(sessions):
    assert len(sessions) == 36
    for session in sessions:
        for turn, (ours, theirs) in enumerate(zip(session.gateway, session.tito, strict=True)):
            assert ours == theirs, (session.family, session.name, turn)


def test_the_episode_loop_renders_every_prompt_as_tito_merges_it(sessions):
    for session in sessions:
        for turn, (ours, theirs) in enumerate(zip(session.episode, session.tito, strict=True)):
            assert ours == theirs, (session.family, session.name, turn)


def test_where_the_template_rewrites_history_the_incremental_prompt_is_not_a_fresh_render(
    sessions,
):
    # Qwen3-Next's and Qwen3.5's templates write an earlier assistant turn otherwise than the
    # turn as generated; TITO (and swerl) keep the sampled ids, so the prompt is no fresh render.
    rewritten = {(s.family, s.name) for s in sessions if s.full != s.tito}
    assert ("Qwen3TITOTokenizer", "LongChainTrajectory") not in rewritten
    assert ("QwenNextTITOTokenizer", "LongChainTrajectory") in rewritten
    assert ("Qwen35TITOTokenizer", "MultiUserToolChainTrajectory") in rewritten
