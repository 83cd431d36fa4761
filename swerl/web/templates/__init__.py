"""Jinja2 templates of the web views (a package, so that a regular install ships them)."""
