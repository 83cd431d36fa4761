"""Log setup of every swerl process: structlog, JSON in production, console in development.

Events are dotted names (`server.started`, `lease.expired`) with units in field names
(`duration_ms`). Context bound with `structlog.contextvars` (the request id, by the boundary
interceptor) lands on every line. Standard-library records (grpc's own, libraries') go through the
same renderer so a JSON log stays one JSON object per line.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Literal

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


# Environment defaults that keep foreign libraries' own lines out of swerl's output. Each is read
# when its library is imported (or its core starts), so they are set before that happens, and
# worker processes (spawned tokenizer workers, services started as subprocesses) inherit them.
QUIET_ENV: dict[str, str] = {
    # transformers advises at import that PyTorch is absent: swerl only loads tokenizers.
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    # grpc core logs INFO lines to stderr itself, e.g. a GOAWAY from a server that stopped with
    # calls open (as every in-process stack does on exit); errors still show.
    "GRPC_VERBOSITY": "ERROR",
}


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes each record to `sys.stderr` as it is at the time of the record, not as it was when
    logging was configured: an embedding process (pytest's capture, a notebook) may replace and
    close the stream it had, and a record written there would be lost with a logging error."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def quiet_foreign_libraries(environ: MutableMapping[str, str] = os.environ) -> None:
    """Sets QUIET_ENV's defaults where the user has not set the variable; call before grpc or
    transformers is imported (the `swerl` command does, first thing)."""
    for name, value in QUIET_ENV.items():
        environ.setdefault(name, value)


def configure_logging(
    log_format: Literal["console", "json"] = "console", level: str = "info"
) -> None:
    """Configures structlog and the root logger; safe to call again (the last call wins)."""
    level_no = _LEVELS[level.lower()]
    shared: list[structlog.typing.Processor] = [
        # First, so explicitly passed fields win over bound context on a clash.
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: structlog.typing.Processor
    if log_format == "json":
        # The console renderer prints tracebacks itself; JSON needs them as a string field.
        shared.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer()
    else:
        # Colour codes only for a terminal; redirected to a file they are noise.
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())

    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.stdlib.LoggerFactory(),
        # Not cached: tests (structlog.testing.capture_logs) and a second call must take effect.
        cache_logger_on_first_use=False,
    )

    handler = _CurrentStderrHandler(sys.stderr)
    handler.set_name("swerl")
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "swerl"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level_no)
