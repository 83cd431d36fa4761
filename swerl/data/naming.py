"""Docker image names of SWE task instances, by the naming rule of the dataset they come from.

Docker refuses `__` in repository names, so each dataset family replaces it with its own token:
SWE-bench's images are `docker.io/swebench/sweb.eval.x86_64.<id, __ as _1776_>:latest`; SWE-Gym's
(built for OpenHands) are `docker.io/xingyaoww/sweb.eval.x86_64.<id, __ as _s_>:latest`. Both are
lower-cased. An explicit `image_name` column always wins; a registry prefix replaces the
`docker.io/<namespace>` part of derived names (a private mirror holding the same images).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Convention = Literal["auto", "swe-bench", "swe-gym"]
CONVENTIONS: tuple[str, ...] = ("auto", "swe-bench", "swe-gym")

# Docker's reference grammar, [registry/]path[:tag][@digest]: a first part is a registry only
# with a dot, a port or as `localhost`; path components are lower case. Rows are checked with
# it when they are read, so a mistyped image_name is the row's error, not a failed episode later
# (the exec node applies the full grammar again, with Docker's length limits).
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REGISTRY = r"(?:(?:localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+)(?::[0-9]+)?|[A-Za-z0-9-]+:[0-9]+)"
IMAGE_REFERENCE = re.compile(
    rf"^(?:{_REGISTRY}/)?{_COMPONENT}(?:/{_COMPONENT})*"
    r"(?::[\w][\w.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$"
)


def is_image_reference(name: str) -> bool:
    """Whether `name` is a well-formed Docker image reference (see IMAGE_REFERENCE)."""
    return bool(IMAGE_REFERENCE.match(name))


@dataclass(frozen=True)
class NamingRule:
    prefix: str  # registry and namespace, without a trailing slash
    separator: str  # what `__` in an instance id becomes


RULES: dict[str, NamingRule] = {
    "swe-bench": NamingRule("docker.io/swebench", "_1776_"),
    "swe-gym": NamingRule("docker.io/xingyaoww", "_s_"),
}


def resolve_convention(convention: str, data_source: str) -> str:
    """`auto` picks SWE-Gym for a data source that names it, SWE-bench otherwise."""
    if convention != "auto":
        if convention not in RULES:
            raise ValueError(f"unknown image naming convention {convention!r}")
        return convention
    return "swe-gym" if "gym" in data_source.lower() else "swe-bench"


def derived_image_name(instance_id: str, convention: str, registry_prefix: str = "") -> str:
    """The image of `instance_id` by the rule of `convention` ('swe-bench' or 'swe-gym')."""
    rule = RULES[convention]
    prefix = registry_prefix.rstrip("/") if registry_prefix else rule.prefix
    name = "sweb.eval.x86_64." + instance_id.replace("__", rule.separator)
    return f"{prefix}/{name}".lower() + ":latest"


def image_name(
    row: dict, *, convention: str, data_source: str = "", registry_prefix: str = ""
) -> str:
    """The row's explicit non-empty `image_name`, else the derived name."""
    explicit = row.get("image_name")
    if isinstance(explicit, str) and explicit.strip():
        return explicit.strip()
    rule = resolve_convention(convention, data_source)
    return derived_image_name(str(row["instance_id"]), rule, registry_prefix)
