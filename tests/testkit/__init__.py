"""The helpers swerl's tests share: running stacks and nodes, status checks, framework stand-ins.

One module per subject (`testkit.exec`, `testkit.agent`, `testkit.dockerd`, ...), imported the
same way everywhere: `from testkit.exec import assert_status`. pytest puts `tests/` on the path
(`pythonpath` in pyproject.toml), so no test edits `sys.path`. Fixtures stay in the conftest
files; what they and the tests call lives here. tests/README.md has the map.
"""
