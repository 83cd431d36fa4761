"""Fixtures of the trainer-plugin tests: a framework stand-in and its sampling params.

The tests run against slime's stand-in (slime_standin) or miles' (miles_standin), chosen by
SWERL_TEST_FRAMEWORK (slime by default); CI runs this folder once with each (scripts/test). What
they build for it (args, samples) is in testkit.plugin.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
from testkit import miles_standin
from testkit.plugin import FRAMEWORK, SAMPLING_PARAMS, STANDINS


@pytest.fixture
def fw(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The framework stand-in (Sample, GenerateState, DynamicFilterOutput, loggers and the
    rollout machinery around the hooks) under the framework's own module names."""
    standin = STANDINS[FRAMEWORK]
    standin.install(monkeypatch)
    for name in [k for k in os.environ if k.startswith("SWERL_PLUGIN_")]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(miles_standin.LEGACY_ENV, raising=False)
    return standin


@pytest.fixture
def sampling_params() -> dict[str, Any]:
    return copy.deepcopy(SAMPLING_PARAMS)
