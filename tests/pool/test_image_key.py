"""One image, many spellings: `swerl.chassis.images.image_key` gives Docker Hub's spellings of a
reference one key, so the pool homes them on the same nodes, a node listing one spelling has the
image under every other, and the exec node pins and counts it under each."""

from __future__ import annotations

import pytest

from swerl.chassis.images import image_key
from swerl.exec.images import ImageCache
from swerl.exec.settings import ExecSettings
from swerl.pool import placement
from swerl.pool.model import image_names

PYTHON_311 = (
    "python:3.11",
    "library/python:3.11",
    "docker.io/python:3.11",
    "docker.io/library/python:3.11",
    "index.docker.io/library/python:3.11",
    "registry-1.docker.io/library/python:3.11",
)
NODE_IDS = [f"node-{i}" for i in range(16)]


@pytest.mark.parametrize("spelling", PYTHON_311)
def test_docker_hub_spellings_of_one_image_have_one_key(spelling):
    assert image_key(spelling) == "python:3.11"


def test_the_two_spellings_of_one_image_hash_to_the_same_home_nodes():
    homes = {spelling: placement.homes(spelling, NODE_IDS, 3) for spelling in PYTHON_311}
    assert len(homes["python:3.11"]) == 3
    assert all(h == homes["python:3.11"] for h in homes.values()), homes
    by_image = placement.homes_by_image(PYTHON_311, NODE_IDS, 3)
    assert {tuple(h) for h in by_image.values()} == {tuple(homes["python:3.11"])}


def test_another_registry_or_tag_is_another_image():
    others = ("ghcr.io/library/python:3.11", "python:3.12", "localhost:5000/python:3.11")
    keys = {image_key(image) for image in others}
    assert len(keys | {"python:3.11"}) == 4
    assert image_key("ghcr.io/library/python:3.11") == "ghcr.io/library/python:3.11"
    # The key, not the hash, made the spellings agree: these land elsewhere.
    for other in others:
        assert placement.homes(other, NODE_IDS, 3) != placement.homes("python:3.11", NODE_IDS, 3)


def test_an_untagged_name_is_latest_and_digests_and_ids_are_kept():
    assert image_key("ubuntu") == "ubuntu:latest"
    assert image_key("docker.io/library/ubuntu") == "ubuntu:latest"
    assert image_key("docker.io/swebench/sweb.eval.x") == "swebench/sweb.eval.x:latest"
    assert image_key("localhost:5000/x") == "localhost:5000/x:latest"
    digest = "sha256:" + "a" * 64
    assert image_key(f"docker.io/library/python@{digest}") == f"python@{digest}"
    assert image_key(f"python:3.11@{digest}") == f"python:3.11@{digest}"
    assert image_key(digest) == digest
    # `library/` is implied only before a one-part Docker Hub name.
    assert image_key("docker.io/library/a/b") == "library/a/b:latest"
    assert image_key("mirror.local/docker.io/x:1") == "mirror.local/docker.io/x:1"


def test_a_node_listing_the_short_name_has_the_image_under_each_spelling():
    for spelling in PYTHON_311:
        assert "python:3.11" in image_names(spelling)


def test_the_exec_node_pins_and_counts_an_image_under_each_spelling(tmp_path):
    settings = ExecSettings(
        pinned_images=["index.docker.io/library/python:3.11"],
        state_dir=str(tmp_path),
        insecure=True,
    )
    in_use = ["docker.io/library/python:3.11", "library/python:3.11"]
    # Pinning and counting read only the settings and the listing's rows.
    puller = ImageCache(settings, backend=None, store=None, in_use=lambda: in_use)  # type: ignore[arg-type]
    row = {"Id": "sha256:" + "b" * 64, "RepoTags": ["python:3.11"], "RepoDigests": []}
    assert puller._is_pinned(row)
    assert puller._in_use_by_id([row])[row["Id"]] == 2
