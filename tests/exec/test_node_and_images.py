"""Node-level calls on a real node: node info, health, and the images dockerd holds."""

from __future__ import annotations

import uuid

from grpc_health.v1 import health_pb2, health_pb2_grpc
from testkit.exec import RPC_TIMEOUT_S

import swerl
from swerl.exec.v1 import sandbox_pb2 as pb


async def test_node_info_reports_identity_capacity_load_and_docker(node_factory, base_image):
    node = await node_factory(max_sandboxes=7)
    await node.create(base_image)
    info = await node.stub.GetNodeInfo(pb.GetNodeInfoRequest(), timeout=RPC_TIMEOUT_S)
    assert info.node_id == node.node.settings.node_id
    assert info.version == swerl.__version__
    assert (info.capacity, info.running) == (7, 1)
    assert info.docker_healthy
    assert info.docker_version
    assert info.docker_error == ""
    assert info.cpus >= 1
    assert info.memory_bytes > 0


async def test_health_of_the_whole_node_is_serving(node):
    health = health_pb2_grpc.HealthStub(node.channel)
    check = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT_S)
    assert check.status == health_pb2.HealthCheckResponse.SERVING


async def test_list_images_contains_the_base_image(node, base_image):
    response = await node.stub.ListImages(pb.ListImagesRequest(), timeout=RPC_TIMEOUT_S)
    matching = [image for image in response.images if base_image in image.repo_tags]
    assert len(matching) == 1
    assert matching[0].image_id.startswith("sha256:")
    assert matching[0].size_bytes > 0
    assert matching[0].create_time.seconds > 0
    assert all("<none>:<none>" not in image.repo_tags for image in response.images)


async def test_ensure_images_reports_each_image_without_failing_the_call(node, base_image):
    unreachable = "localhost:5999/nope:1"
    malformed = "Not A/Reference"
    request = pb.EnsureImagesRequest(
        request_id=uuid.uuid4().hex, images=[base_image, unreachable, malformed]
    )
    results = {}
    async for response in node.stub.EnsureImages(request, timeout=RPC_TIMEOUT_S):
        if response.WhichOneof("kind") == "result":
            assert response.result.image not in results, "one result per image"
            results[response.result.image] = response.result

    assert set(results) == {base_image, unreachable, malformed}
    assert results[base_image].status == pb.IMAGE_PULL_STATUS_PRESENT
    assert results[unreachable].status == pb.IMAGE_PULL_STATUS_FAILED
    assert results[unreachable].reason == "REGISTRY_UNREACHABLE", results[unreachable].message
    assert results[malformed].status == pb.IMAGE_PULL_STATUS_FAILED
    assert results[malformed].reason == "INVALID_IMAGE_REFERENCE"
