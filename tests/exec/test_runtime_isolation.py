"""The node's isolation class is the kernel its sandboxes' syscalls reach (issue 38): under
`--isolation gvisor` a sandbox's commands run on gVisor's own kernel ("Starting gVisor..." in
its log), under runc on the host's. This file runs in every runtime lane of scripts/test
(SWERL_EXEC_RUNTIME / SWERL_EXEC_ISOLATION / DOCKER_HOST name the lane), so each lane proves
it is the runtime it says it is."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.docker


async def test_a_sandbox_runs_on_the_kernel_of_its_isolation_class(node, base_image) -> None:
    settings = node.node.settings
    sandbox = await node.create(base_image, workdir="/tmp")
    out = await node.client.run(sandbox.sandbox_id, "dmesg 2>&1 | head -n 3; uname -r")
    seen = (out.stdout + out.stderr).decode(errors="replace")
    if settings.isolation == "gvisor":
        assert "Starting gVisor" in seen, seen
    else:
        assert "gVisor" not in seen, seen
    assert node.node.backend.runtime_name == settings.runtime
