"""One spelling of an image reference: `image_key`, the name every service compares images by.

A Docker reference may name one image several ways: `python:3.11`, `library/python:3.11`,
`docker.io/library/python:3.11`, `index.docker.io/library/python:3.11` and
`registry-1.docker.io/python:3.11` are all Docker Hub's `library/python` at tag `3.11`. The pool
hashes images to home nodes, matches them to what a node lists and counts pulls by image; the
exec node matches them to what dockerd lists. Each goes through `image_key`, so the spellings
agree everywhere.

The key is the name as Docker lists it in `RepoTags` / `RepoDigests` (its "familiar" form): no
Docker Hub registry, no `library/` before a one-part Docker Hub name, and `:latest` where the
reference has neither tag nor digest. A digest is kept as written (`python@sha256:…` is not
`python:latest`), and so is an image id (`sha256:…`). Another registry (`ghcr.io/…`,
`localhost:5000/…`) keeps its name: only Docker Hub has other spellings.

Pure: no I/O, no grpc; both the pool and the exec node import it.
"""

from __future__ import annotations

import functools

# The hosts Docker Hub answers under; a reference naming one of them is a Docker Hub reference.
DOCKER_HUB_REGISTRIES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})
# Docker Hub's namespace of official images, implied before a one-part name (`python`).
_OFFICIAL_NAMESPACE = "library/"


def _is_registry(component: str) -> bool:
    """Whether a reference's first path component is a registry host (Docker's rule: it has a
    dot or a port, or is `localhost`), not a Docker Hub namespace such as `swebench`."""
    return "." in component or ":" in component or component == "localhost"


@functools.lru_cache(maxsize=8192)
def image_key(image: str) -> str:
    """The name `image` is compared and hashed under: Docker's listed form of the reference.

    `docker.io/library/python:3.11`, `index.docker.io/library/python:3.11`,
    `library/python:3.11` and `python:3.11` are all `python:3.11`; `swebench/x` is
    `swebench/x:latest`; `ghcr.io/org/x` is `ghcr.io/org/x:latest`; digests and ids are kept."""
    if image.startswith("sha256:"):
        return image
    first, slash, rest = image.partition("/")
    if slash and _is_registry(first):
        if first not in DOCKER_HUB_REGISTRIES:
            return _tagged(image)
        path = rest
    else:
        path = image
    # A Docker Hub name: its official images are listed without their namespace.
    if path.startswith(_OFFICIAL_NAMESPACE) and "/" not in path[len(_OFFICIAL_NAMESPACE) :]:
        path = path[len(_OFFICIAL_NAMESPACE) :]
    return _tagged(path)


def _tagged(reference: str) -> str:
    """`reference` with `:latest` added when it has neither a tag nor a digest."""
    if "@" in reference:
        return reference
    last = reference.rsplit("/", 1)[-1]
    return reference if ":" in last else reference + ":latest"
