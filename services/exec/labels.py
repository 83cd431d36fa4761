"""The labels swerl puts on every container it creates, so nothing it made is unaccounted for."""

from __future__ import annotations

# Every label swerl puts on a container starts with this; callers' own labels with USER_LABEL.
LABEL_PREFIX = "swerl."
USER_LABEL = LABEL_PREFIX + "user."
ENV_LABEL = LABEL_PREFIX + "env."  # the sandbox's environment, for adoption after a restart
