"""Optional dependencies: the Python packages a part of swerl imports only when it runs, each
brought by one of swerl's extras (pyproject.toml). A part checks them before it starts work, so a
missing one is a clear refusal naming what to install, never an ImportError in the middle of it.

Pure domain: no gRPC.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class OptionalPackage:
    """A package some part of swerl imports, and the extra of swerl that installs it."""

    # What the part imports (probed, never imported, by `installed`).
    module: str
    # Its name on PyPI.
    distribution: str
    # swerl's extra that brings it (`pip install 'swerl[<extra>]'`).
    extra: str

    def installed(self) -> bool:
        """Whether `import <module>` can find it here, without importing it (which can take
        seconds, or print)."""
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):  # a parent package missing, or a broken __spec__
            return False


def missing(packages: Iterable[OptionalPackage]) -> list[OptionalPackage]:
    """Those of `packages` that are not installed, in order."""
    return [package for package in packages if not package.installed()]


def install_hint(packages: Iterable[OptionalPackage]) -> str:
    """The one command that installs `packages`: `pip install 'swerl[a,b]'`."""
    extras = sorted({package.extra for package in packages})
    return f"pip install 'swerl[{','.join(extras)}]'"


def describe_missing(packages: list[OptionalPackage]) -> str:
    """`mini-swe-agent (import minisweagent)`, joined: what is missing, by the names a reader
    looks up."""
    return ", ".join(f"{p.distribution} (import {p.module})" for p in packages)


__all__ = ["OptionalPackage", "describe_missing", "install_hint", "missing"]
