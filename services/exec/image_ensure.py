"""Image references and EnsureImages: which names are images, and making a list of them present.

`validate_image_reference` is Docker's reference grammar (name[:tag][@digest]) or a full image
id, checked before anything reaches dockerd. `ensure_images` makes each distinct image of a list
present through the node's `ImageCache` (pull, mirror, evict), at most `concurrency` at a time,
and streams every pull's progress and each image's final status as `ImageEvent`s.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from swerl.exec.errors import InvalidImageReference
from swerl.exec.images import ImageCache, PullProgress

# The final statuses of an image in EnsureImages.
PULL_RESULTS = ("PRESENT", "PULLED", "FAILED")

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)"
_DOMAIN = rf"(?:{_HOST}(?:\.{_HOST})*|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?"
_IMAGE_REF = re.compile(
    rf"^(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*"
    r"(?::[\w][\w.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)
_IMAGE_ID = re.compile(r"^sha256:[0-9a-f]{64}$")


# Docker's limit on a repository name (domain and path, without tag or digest).
_NAME_MAX = 255


def validate_image_reference(image: str) -> None:
    """Docker's reference grammar (name[:tag][@digest]) or a full image id."""
    if not image:
        raise InvalidImageReference("image is required")
    if _IMAGE_ID.match(image):
        return
    if len(image) > 512 or not _IMAGE_REF.match(image):
        raise InvalidImageReference(f"malformed image reference {image!r}", image=image)
    name = image.partition("@")[0]
    if name.rfind(":") > name.rfind("/"):
        name = name[: name.rfind(":")]
    if len(name) > _NAME_MAX:
        raise InvalidImageReference(
            f"repository name of {image[:80]!r}... is longer than {_NAME_MAX} characters",
            image=image[:_NAME_MAX],
        )
    # As Docker reads it, a first component is a registry only if it has a dot or a port or is
    # `localhost`; otherwise it is part of the repository path, which must be lower case.
    first, slash, _ = name.partition("/")
    is_registry = slash and ("." in first or ":" in first or first == "localhost")
    if not is_registry and first != first.lower():
        raise InvalidImageReference(f"repository name must be lower case: {image!r}", image=image)


@dataclass(frozen=True)
class ImageEvent:
    """Progress (status set, final False) or the final result of one image."""

    image: str
    final: bool
    status: str  # progress: Docker's status; final: PRESENT | PULLED | FAILED
    current_bytes: int = 0
    total_bytes: int = 0
    reason: str = ""
    message: str = ""
    duration_s: float = 0.0
    size_bytes: int = 0
    evicted: tuple[str, ...] = ()


async def ensure_images(
    cache: ImageCache, images: list[str], mirror_prefix: str, concurrency: int
) -> AsyncIterator[ImageEvent]:
    """Each distinct image of `images` made present; progress and final events as they come."""
    queue: asyncio.Queue[ImageEvent | None] = asyncio.Queue()
    limit = asyncio.Semaphore(max(concurrency, 1))

    async def one(image: str) -> None:
        async with limit:
            await queue.put(await _ensure_one(cache, image, mirror_prefix, queue))

    async def all_images() -> None:
        try:
            await asyncio.gather(*(one(image) for image in dict.fromkeys(images)))
        finally:
            await queue.put(None)

    runner = asyncio.get_running_loop().create_task(all_images())
    try:
        while (event := await queue.get()) is not None:
            yield event
    finally:
        runner.cancel()


async def _ensure_one(
    cache: ImageCache, image: str, mirror_prefix: str, queue: asyncio.Queue[ImageEvent | None]
) -> ImageEvent:
    started = time.monotonic()
    try:
        validate_image_reference(image)
    except InvalidImageReference as exc:
        return ImageEvent(
            image, True, "FAILED", reason="INVALID_IMAGE_REFERENCE", message=exc.message
        )

    def progress(p: PullProgress) -> None:
        queue.put_nowait(ImageEvent(image, False, p.status, p.current_bytes, p.total_bytes))

    outcome = await cache.ensure(image, mirror_prefix, progress)
    return ImageEvent(
        image,
        True,
        outcome.status,
        reason=outcome.reason,
        message=outcome.message,
        duration_s=time.monotonic() - started,
        size_bytes=outcome.size_bytes,
        evicted=outcome.evicted,
    )
