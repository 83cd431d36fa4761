"""`swerl dashboard` as a user starts it: it binds 127.0.0.1 unless told otherwise, and neither
the page nor the JSON behind it shows anything without the services' bearer token. (The browser
test against a running stack, test_dashboard_browser.py, serves the app itself.)"""

from __future__ import annotations

import json
import socket
import time
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pytest
from testkit.web import Served


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def dashboard(monkeypatch):
    monkeypatch.delenv("SWERL_TOKEN", raising=False)
    served = Served(
        "dashboard",
        *("--pool", f"127.0.0.1:{_closed_port()}", "--port", "0"),
        *("--token", "the-token", "--interval", "0.2"),
    )
    yield served
    served.stop()


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of the IPv4/IPv6 sockets listening on `port` (Linux /proc/net)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def test_the_dashboard_binds_loopback_by_default(dashboard):
    assert dashboard.url.startswith("http://127.0.0.1:")
    port = int(dashboard.url.rsplit(":", 1)[1])
    # One listening socket, on 127.0.0.1 (0100007F as the kernel writes it), not 0.0.0.0.
    assert _listening_addresses(port) == {"0100007F"}


def test_nothing_is_shown_without_the_token(dashboard):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for path in ("/", "/api/state"):
            with pytest.raises(HTTPError) as err:
                urlopen(Request(dashboard.url + path, headers=headers), timeout=10)
            assert err.value.code == 401
    # The sign-in page asks for the token and shows no fleet data.
    with pytest.raises(HTTPError) as err:
        urlopen(dashboard.url + "/", timeout=10)
    page = err.value.read().decode()
    assert 'id="token"' in page and 'id="nodes"' not in page
    # With it, the JSON answers (here: the pool cannot be reached, and says so).
    request = Request(dashboard.url + "/api/state", headers={"Authorization": "Bearer the-token"})
    state: dict = {}
    for _ in range(50):
        with urlopen(request, timeout=10) as response:
            state = json.loads(response.read())
        if state.get("ready"):
            break
        time.sleep(0.2)
    assert state["ready"] and state["nodes"] == []
    assert any("UNAVAILABLE" in error for error in state["errors"]), state["errors"]
