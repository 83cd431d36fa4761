"""A lease holder as its own process, for the chaos tests: acquires a lease, prints it as one
JSON line, keeps it alive, and waits to be killed."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from swerl.pool.client import PoolClient


async def main(address: str, image: str, ttl_s: float) -> None:
    pool = PoolClient(address, token=os.environ["SWERL_TEST_TOKEN"])
    async with pool.lease(image, owner="holder", ttl_s=ttl_s) as lease:
        info = {"lease_id": lease.lease_id, "sandbox_id": lease.sandbox_id}
        print(json.dumps(info), flush=True)
        await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
