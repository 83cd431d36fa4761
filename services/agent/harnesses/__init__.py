"""Harnesses that drive an episode in its sandbox (EpisodeOptions.harness), by name.

Adding one is one module beside `builtin` and one line in `HARNESSES`."""

from __future__ import annotations

from swerl.agent.errors import UnknownHarness
from swerl.agent.harnesses.base import (
    Harness,
    HarnessFactory,
    HarnessFailed,
    HarnessModel,
    HarnessRun,
)
from swerl.agent.harnesses.builtin import BuiltinHarness
from swerl.agent.harnesses.claude_code import ClaudeCodeHarness
from swerl.agent.harnesses.mini_swe_agent import MiniSweAgentHarness
from swerl.agent.spec import DEFAULT_HARNESS

# name -> factory of one harness per episode.
HARNESSES: dict[str, HarnessFactory] = {
    BuiltinHarness.name: BuiltinHarness,
    "claude-code": ClaudeCodeHarness,
    "mini-swe-agent": MiniSweAgentHarness,
}


def harness_named(name: str) -> Harness:
    """A fresh harness for one episode; empty means the default. Unknown: UnknownHarness."""
    factory = HARNESSES.get(name or DEFAULT_HARNESS)
    if factory is None:
        known = ", ".join(sorted(HARNESSES))
        raise UnknownHarness(f"no harness named {name!r} (known: {known})", harness=name)
    return factory()


__all__ = [
    "DEFAULT_HARNESS",
    "HARNESSES",
    "Harness",
    "HarnessFactory",
    "HarnessFailed",
    "HarnessModel",
    "HarnessRun",
    "UnknownHarness",
    "harness_named",
]
