"""What both web apps share: the Jinja2 environment over this package's templates and the
chart library served from its installed Python package (plotly ships plotly.min.js)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("swerl.web", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
)


def fmt_num(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


_ENV.filters["num"] = fmt_num


def render(template: str, status: int = 200, **context: Any) -> web.Response:
    body = _ENV.get_template(template).render(**context)
    return web.Response(text=body, status=status, content_type="text/html")


def plotly_js_path() -> Path:
    """plotly.min.js as the installed plotly package ships it (found without importing plotly,
    which would pull its whole Python side into the server)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or spec.origin is None:
        raise RuntimeError("the plotly package is not installed (pip install 'swerl[web]')")
    return Path(spec.origin).parent / "package_data" / "plotly.min.js"
