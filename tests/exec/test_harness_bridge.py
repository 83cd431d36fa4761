"""In-sandbox harness plumbing on a real exec node: the read-only bundle, the gateway bridge and
the forwarder, proved from inside a `network none` sandbox."""

from __future__ import annotations

import asyncio
import json
import os

import grpc
import pytest
from aiohttp import web
from testkit.exec import RPC_TIMEOUT_S, assert_status, rpc_error

from swerl.exec.bundles import BUNDLE_MOUNT, HARNESS_PACKAGES
from swerl.exec.v1 import sandbox_pb2 as pb

SECRET = "session-secret-0"
UNKNOWN = "sbx-00000000000000000000"


class GatewayStandIn:
    """An HTTP endpoint on the host's loopback standing where the gateway would: records what
    reached it and answers with an Anthropic-shaped body."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _any(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append((request.method, request.path_qs, dict(request.headers), body))
        return web.json_response({"type": "message", "echo": request.path_qs})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._any)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "0.0.0.0", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def stand_in():
    server = GatewayStandIn()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def harness_node(node_factory, harness_bundle_dir):
    return await node_factory(harness_bundle_dir=harness_bundle_dir)


async def _open(node, sandbox_id: str, port: int) -> pb.OpenHarnessResponse:
    request = pb.OpenHarnessRequest(
        sandbox_id=sandbox_id,
        harness="claude-code",
        gateway_url=f"http://127.0.0.1:{port}/s/sess-1",
        gateway_api_key=SECRET,
    )
    return await node.stub.OpenHarness(request, timeout=600)


# Run inside the sandbox by the bundle's Node: each probe prints one JSON line.
PROBE_JS = r"""
const net = require('net');
const [fwdPort, gatewayPort] = process.argv.slice(2).map(Number);
function connect(host, port) {
  return new Promise((resolve) => {
    const socket = net.connect({ host, port, timeout: 3000 });
    socket.on('connect', () => { socket.destroy(); resolve('connected'); });
    socket.on('timeout', () => { socket.destroy(); resolve('timeout'); });
    socket.on('error', (err) => resolve(err.code || err.message));
  });
}
(async () => {
  const response = await fetch(`http://127.0.0.1:${fwdPort}/v1/messages?beta=true`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', 'x-api-key': 'sk-from-the-sandbox' },
    body: JSON.stringify({ hello: 'gateway' }),
  });
  const body = await response.json();
  console.log(JSON.stringify({ probe: 'forwarder', status: response.status, body }));
  const targets = [
    ['127.0.0.1', gatewayPort], ['172.17.0.1', gatewayPort], ['1.1.1.1', 443],
    ['8.8.8.8', 53], ['10.0.0.1', 80], ['::1', gatewayPort],
  ];
  for (const [host, port] of targets) {
    console.log(JSON.stringify({ probe: `${host}:${port}`, result: await connect(host, port) }));
  }
  const dns = require('dns').promises;
  const resolved = await dns.lookup('pypi.org').then(() => 'resolved', (err) => err.code);
  console.log(JSON.stringify({ probe: 'dns', result: resolved }));
})();
"""


async def test_from_inside_a_sandbox_only_the_forwarder_reaches_out(
    harness_node, base_image, stand_in
):
    sandbox = await harness_node.create(base_image, workdir="/tmp")
    assert sandbox.network == pb.NETWORK_MODE_NONE
    opened = await _open(harness_node, sandbox.sandbox_id, stand_in.port)
    assert opened.gateway_socket == "/.swerl-io/gateway.sock"
    assert opened.bundle_dir.startswith(BUNDLE_MOUNT + "/claude-code-")
    assert opened.version == HARNESS_PACKAGES["claude-code"].default_version
    client = harness_node.client
    sid = sandbox.sandbox_id
    start = await client.run(
        sid,
        f"set -m; {opened.node} {opened.forwarder} {opened.gateway_socket} 0 /tmp/fwd.port"
        " </dev/null >/tmp/fwd.log 2>&1 & set +m;"
        " for i in $(seq 100); do [ -s /tmp/fwd.port ] && break; sleep 0.1; done;"
        " cat /tmp/fwd.port",
        timeout_s=30,
    )
    assert start.exit_code == 0, start.stderr
    port = int(start.stdout.decode())
    await client.run(sid, "cat > /tmp/probe.js", stdin=PROBE_JS.encode(), timeout_s=30)
    probe = await client.run(
        sid, f"{opened.node} /tmp/probe.js {port} {stand_in.port}", timeout_s=60
    )
    assert probe.exit_code == 0, probe.stderr
    lines = {row["probe"]: row for row in map(json.loads, probe.stdout.decode().splitlines())}
    # The forwarder reaches the session, and only it: the path lands under the session's URL,
    # the sandbox's own key is replaced by the session's secret.
    assert lines["forwarder"]["status"] == 200
    assert lines["forwarder"]["body"]["echo"] == "/s/sess-1/v1/messages?beta=true"
    method, path, headers, body = stand_in.seen[-1]
    assert (method, path, json.loads(body)) == (
        "POST",
        "/s/sess-1/v1/messages?beta=true",
        {"hello": "gateway"},
    )
    assert headers["x-api-key"] == SECRET and headers["Authorization"] == f"Bearer {SECRET}"
    # Every other address fails, the gateway's own port included, and no name resolves.
    for target in (
        f"127.0.0.1:{stand_in.port}",
        f"172.17.0.1:{stand_in.port}",
        "1.1.1.1:443",
        "8.8.8.8:53",
        "10.0.0.1:80",
        f"::1:{stand_in.port}",
    ):
        assert lines[target]["result"] in ("ECONNREFUSED", "ENETUNREACH", "EADDRNOTAVAIL"), (
            target,
            lines[target],
        )
    assert lines["dns"]["result"] in ("ENOTFOUND", "EAI_AGAIN")
    assert len(stand_in.seen) == 1  # nothing but the forwarded request arrived


async def test_the_bundle_is_read_only_and_the_bridge_goes_with_its_sandbox(
    harness_node, base_image, stand_in
):
    sandbox = await harness_node.create(base_image, workdir="/tmp")
    opened = await _open(harness_node, sandbox.sandbox_id, stand_in.port)
    client = harness_node.client
    write = await client.run(
        sandbox.sandbox_id,
        f"touch {opened.bundle_dir}/x; echo $?; touch {BUNDLE_MOUNT}/y; echo $?;"
        f" {opened.harness_binary} --version",
        timeout_s=60,
    )
    codes = write.stdout.decode().split()
    assert codes[:2] == ["1", "1"], write.stdout
    assert HARNESS_PACKAGES["claude-code"].default_version in write.stdout.decode()
    io_dir = harness_node.node.manager.io_dir(sandbox.sandbox_id)
    assert (io_dir / "gateway.sock").exists()
    await harness_node.stub.DestroySandbox(
        pb.DestroySandboxRequest(sandbox_id=sandbox.sandbox_id), timeout=RPC_TIMEOUT_S
    )
    for _ in range(50):
        if harness_node.node.harnesses.bridges.counts(sandbox.sandbox_id) == (0, 0):
            break
        await asyncio.sleep(0.1)
    assert not (io_dir / "gateway.sock").exists()
    assert sandbox.sandbox_id not in harness_node.node.harnesses.bridges._bridges


@pytest.mark.parametrize(
    ("fields", "code", "reason"),
    [
        (
            {"harness": "no-such-cli", "gateway_url": "http://127.0.0.1:1/s/x"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "UNKNOWN_HARNESS_BUNDLE",
        ),
        (
            {"harness": "claude-code", "version": "latest", "gateway_url": "http://h:1/s/x"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_HARNESS_VERSION",
        ),
        (
            {"harness": "claude-code", "gateway_url": "unix:///var/run/docker.sock"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_GATEWAY_URL",
        ),
        (
            {"harness": "claude-code", "gateway_url": "http://h:1/s/x?a=b"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_GATEWAY_URL",
        ),
    ],
)
async def test_bad_open_harness_requests(harness_node, base_image, fields, code, reason):
    sandbox = await harness_node.create(base_image, workdir="/tmp")
    request = pb.OpenHarnessRequest(sandbox_id=sandbox.sandbox_id, **fields)
    err = await rpc_error(harness_node.stub.OpenHarness(request, timeout=RPC_TIMEOUT_S))
    assert_status(err, code, reason)


async def test_open_harness_on_an_unknown_sandbox(harness_node):
    request = pb.OpenHarnessRequest(
        sandbox_id=UNKNOWN, harness="claude-code", gateway_url="http://127.0.0.1:1/s/x"
    )
    err = await rpc_error(harness_node.stub.OpenHarness(request, timeout=RPC_TIMEOUT_S))
    assert_status(err, grpc.StatusCode.NOT_FOUND, "SANDBOX_NOT_FOUND")


async def test_a_bundle_the_node_cannot_build_is_unavailable(node_factory, tmp_path, base_image):
    # An empty bundle directory and a package index nobody serves: the build fails, nothing
    # is left under the bundle's name.
    bundles = tmp_path / "empty-bundles"
    running = await node_factory(
        harness_bundle_dir=bundles, harness_package_index="http://127.0.0.1:9/simple"
    )
    sandbox = await running.create(base_image, workdir="/tmp")
    request = pb.OpenHarnessRequest(
        sandbox_id=sandbox.sandbox_id, harness="claude-code", gateway_url="http://h:1/s/x"
    )
    err = await rpc_error(running.stub.OpenHarness(request, timeout=300))
    assert_status(err, grpc.StatusCode.UNAVAILABLE, "BUNDLE_BUILD_FAILED")
    assert "pip download" in (err.details() or "")
    assert os.listdir(bundles) == []


async def _via_socket(socket_path, method: str, path: str, **kwargs):
    """One request on the bridge's socket from the host, through a short link to its directory
    (a test's state directory is deeper than a socket address allows)."""
    import tempfile

    import aiohttp

    with tempfile.TemporaryDirectory(dir="/tmp") as short:
        link = os.path.join(short, "io")
        os.symlink(socket_path.parent, link)
        connector = aiohttp.UnixConnector(path=os.path.join(link, socket_path.name))
        async with aiohttp.ClientSession(connector=connector) as session:
            async with session.request(method, f"http://sandbox{path}", **kwargs) as response:
                return response.status, await response.json(content_type=None)


async def test_a_gateway_the_bridge_cannot_reach_is_a_502_in_the_anthropic_error_shape(
    harness_node, base_image
):
    sandbox = await harness_node.create(base_image, workdir="/tmp")
    # Nothing listens on port 9 of the host's loopback.
    request = pb.OpenHarnessRequest(
        sandbox_id=sandbox.sandbox_id, harness="claude-code", gateway_url="http://127.0.0.1:9/s/x"
    )
    await harness_node.stub.OpenHarness(request, timeout=RPC_TIMEOUT_S)
    socket_path = harness_node.node.manager.io_dir(sandbox.sandbox_id) / "gateway.sock"
    status, body = await _via_socket(socket_path, "POST", "/v1/messages", json={})
    assert status == 502
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    assert "gateway is unreachable" in body["error"]["message"]
    assert harness_node.node.harnesses.bridges.counts(sandbox.sandbox_id) == (1, 1)


async def test_the_bridge_reaches_only_below_its_session(harness_node, base_image, stand_in):
    sandbox = await harness_node.create(base_image, workdir="/tmp")
    await _open(harness_node, sandbox.sandbox_id, stand_in.port)
    socket_path = harness_node.node.manager.io_dir(sandbox.sandbox_id) / "gateway.sock"
    # A path that climbs out of the session still lands below it (the gateway answers 404 to
    # what it does not serve there); opening again re-targets the same socket.
    for path in ("/../other/v1/messages", "/%2e%2e/other/v1/models", "//evil.example/v1"):
        status, body = await _via_socket(socket_path, "GET", path)
        assert status == 200
        assert body["echo"].startswith("/s/sess-1/"), (path, body)
    request = pb.OpenHarnessRequest(
        sandbox_id=sandbox.sandbox_id,
        harness="claude-code",
        gateway_url=f"http://127.0.0.1:{stand_in.port}/s/sess-2",
    )
    await harness_node.stub.OpenHarness(request, timeout=RPC_TIMEOUT_S)
    status, body = await _via_socket(socket_path, "GET", "/v1/models")
    assert (status, body["echo"]) == (200, "/s/sess-2/v1/models")


def test_swerl_exec_bundle_builds_once_and_names_the_bundle(harness_bundle_dir):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "swerl.cli", "exec", "bundle", "--dir", str(harness_bundle_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    version = HARNESS_PACKAGES["claude-code"].default_version
    assert (
        out.stdout.strip() == f"claude-code {version}: {harness_bundle_dir}/claude-code-{version}"
    )
