"""The node's side of in-sandbox harnesses: a sandbox gets its harness's bundle (built once per
node, see swerl.exec.bundles) and its gateway bridge (swerl.exec.gateway_bridge)."""

from __future__ import annotations

from dataclasses import dataclass

from swerl.exec.bundles import HarnessBundles, harness_package
from swerl.exec.gateway_bridge import BRIDGE_SOCKET, GatewayBridges, check_gateway_url
from swerl.exec.sandboxes import SandboxManager, SandboxRecord
from swerl.exec.shell import CONTAINER_IO_DIR


@dataclass(frozen=True)
class OpenedHarness:
    """Where a readied sandbox finds its harness, all paths inside the sandbox."""

    bundle_dir: str
    node: str
    harness_binary: str
    forwarder: str
    gateway_socket: str
    version: str


class HarnessHost:
    def __init__(self, manager: SandboxManager, bundles: HarnessBundles) -> None:
        self._m = manager
        self.bundles = bundles
        self.bridges = GatewayBridges()
        manager.after_destroy.append(self._destroyed)

    def _destroyed(self, record: SandboxRecord) -> None:
        self.bridges.close_soon(record.sandbox_id)

    async def open(
        self, sandbox_id: str, harness: str, version: str, gateway_url: str, api_key: str
    ) -> OpenedHarness:
        check_gateway_url(gateway_url)
        harness_package(harness, version)
        self._m.get(sandbox_id)  # SANDBOX_NOT_FOUND before any build
        bundle = await self.bundles.ensure(harness, version)
        self._m.get(sandbox_id)  # still there after a long build
        await self.bridges.open(sandbox_id, self._m.io_dir(sandbox_id), gateway_url, api_key)
        return OpenedHarness(
            bundle_dir=bundle.inside,
            node=bundle.node,
            harness_binary=bundle.binary,
            forwarder=bundle.forwarder,
            gateway_socket=f"{CONTAINER_IO_DIR}/{BRIDGE_SOCKET}",
            version=bundle.version,
        )

    async def stop(self) -> None:
        await self.bridges.close_all()
