"""A row's image name finds the image a node lists: Docker lists Docker Hub images without
`docker.io/` (and `library/`), and an untagged name means `:latest`."""

from __future__ import annotations

from swerl.pool.model import image_names


def test_a_docker_hub_name_matches_the_short_name_docker_lists():
    row_image = "docker.io/swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert "swebench/sweb.eval.x86_64.django_1776_django-11099:latest" in image_names(row_image)
    assert "ubuntu:latest" in image_names("docker.io/library/ubuntu")


def test_names_of_other_registries_and_tags_are_taken_as_written():
    assert image_names("swerl-base:bookworm") == ("swerl-base:bookworm",)
    assert image_names("localhost:5000/x") == ("localhost:5000/x", "localhost:5000/x:latest")
    assert image_names("mirror.local/docker.io/x:1") == ("mirror.local/docker.io/x:1",)
