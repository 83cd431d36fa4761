"""Harnesses that drive an episode in its sandbox (EpisodeOptions.harness), by name.

Adding one is one module beside `builtin` and one line in `HARNESSES`; a harness that imports an
optional package when it runs lists it in its class's `requires` (swerl.chassis.extras), so an
agent without it refuses the episode up front (HARNESS_UNAVAILABLE) instead of failing inside it."""

from __future__ import annotations

from collections.abc import Sequence

from swerl.agent.errors import HarnessUnavailable, UnknownHarness
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
from swerl.chassis.extras import OptionalPackage, describe_missing, install_hint, missing

# name -> factory of one harness per episode.
HARNESSES: dict[str, HarnessFactory] = {
    BuiltinHarness.name: BuiltinHarness,
    "claude-code": ClaudeCodeHarness,
    "mini-swe-agent": MiniSweAgentHarness,
}


def requirements_of(factory: HarnessFactory) -> Sequence[OptionalPackage]:
    """The optional packages a harness imports when it runs: its class's `requires` (a factory
    that is not a harness class, such as a test's, declares none)."""
    return tuple(getattr(factory, "requires", ()))


def check_installed(name: str) -> None:
    """Raises HarnessUnavailable when harness `name` ("" = the default) is one of HARNESSES and
    a package it imports is missing in this process. An unknown name passes: `harness_named`
    refuses it where the episode is checked."""
    factory = HARNESSES.get(name or DEFAULT_HARNESS)
    if factory is None:
        return
    absent = missing(requirements_of(factory))
    if absent:
        hint = install_hint(absent)
        named = name or DEFAULT_HARNESS
        raise HarnessUnavailable(
            f"harness {named!r} needs {describe_missing(absent)}, not installed here: {hint}",
            harness=named,
            packages=",".join(p.distribution for p in absent),
            install=hint,
        )


def harness_named(name: str) -> Harness:
    """A fresh harness for one episode; empty means the default. Unknown: UnknownHarness; one
    whose packages are missing here: HarnessUnavailable."""
    factory = HARNESSES.get(name or DEFAULT_HARNESS)
    if factory is None:
        known = ", ".join(sorted(HARNESSES))
        raise UnknownHarness(f"no harness named {name!r} (known: {known})", harness=name)
    check_installed(name)
    return factory()


__all__ = [
    "DEFAULT_HARNESS",
    "HARNESSES",
    "Harness",
    "HarnessFactory",
    "HarnessFailed",
    "HarnessModel",
    "HarnessRun",
    "HarnessUnavailable",
    "UnknownHarness",
    "check_installed",
    "harness_named",
    "requirements_of",
]
