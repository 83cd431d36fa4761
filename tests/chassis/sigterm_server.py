"""A tiny swerl server for the SIGTERM test: prints its port, serves until a signal, exits.

Protocol on stdout, one line each: `port <n>` once serving, `slow-call-started` when the slow
call (RenewSandbox, sleeping for its ttl) begins, `exited` after serve_until_signal returned.
Logs go to stderr as JSON.
"""

from __future__ import annotations

import asyncio
from typing import Any

from testkit.chassis import SANDBOX_SERVICE, ChassisTestServicer, ChassisTestSettings

from swerl.chassis.logging import configure_logging
from swerl.chassis.server import GrpcServer
from swerl.exec.v1 import sandbox_pb2_grpc


class AnnouncingServicer(ChassisTestServicer):
    async def RenewSandbox(self, request: Any, context: Any) -> Any:
        print("slow-call-started", flush=True)
        return await super().RenewSandbox(request, context)


async def main() -> None:
    settings = ChassisTestSettings(insecure=True, drain_grace_s=20, log_format="json")
    configure_logging(settings.log_format, settings.log_level)
    server = GrpcServer(settings, name="sigterm-test")
    server.add_service(
        sandbox_pb2_grpc.add_SandboxServiceServicer_to_server,
        AnnouncingServicer(),
        [SANDBOX_SERVICE],
    )
    port = await server.start()
    print(f"port {port}", flush=True)
    await server.serve_until_signal()
    print("exited", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
