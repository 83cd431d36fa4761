"""Parse and order semantic versions."""

from semverlite.compare import compare, newest
from semverlite.version import Version

__all__ = ["Version", "compare", "newest"]
