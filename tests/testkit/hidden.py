"""Installed packages made to look absent, as on a machine that never installed them.

Both ways set `sys.modules[name] = None` for each hidden top-level package, which is how Python
itself marks a module as unimportable: `import name` (and `import name.sub`) raises
ModuleNotFoundError, and `importlib.util.find_spec(name)` returns None, exactly as for a package
that is not installed, whatever site-packages holds.

- `hide_here(monkeypatch, names)`: in this process, for one test (a module already imported
  stays hidden too; monkeypatch puts it back afterwards).
- `hiding_env(folder, names)`: the environment of a Python subprocess that hides them from its
  start (a `sitecustomize` on PYTHONPATH, run by `site` before any of the program's imports).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest


def hide_here(monkeypatch: pytest.MonkeyPatch, names: Iterable[str]) -> None:
    for name in names:
        assert "." not in name, "hide a top-level package"
        monkeypatch.setitem(sys.modules, name, None)


def hiding_env(folder: Path, names: Iterable[str], **extra: str) -> dict[str, str]:
    """os.environ for a subprocess in which `names` are not importable, plus `extra`."""
    folder.mkdir(parents=True, exist_ok=True)
    hidden = sorted(names)
    (folder / "sitecustomize.py").write_text(
        f"import sys\nfor name in {hidden!r}:\n    sys.modules[name] = None\n"
    )
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


__all__ = ["hide_here", "hiding_env"]
