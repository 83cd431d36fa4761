"""The exec node's image cache: pulls task images on demand, within a disk budget.

A dataset's task images do not fit on one node, so the node keeps a cache: the images it pulled
or created a sandbox from, remembered by Docker id in its store with their last use. When a pull
would take the cached images past `image_disk_budget`, the least recently used images that no
sandbox uses (running, spare or being created), that are not being pulled and that are not
pinned (`pinned_images` and the base image) are removed first, by id and without force, so
Docker itself refuses to remove one a container still holds. Other images on the dockerd (built
or loaded by hand, never pulled or used by the node) are outside the cache: neither counted nor
evicted.

Sizes are Docker's unpacked image size (`docker images`), each image counted whole, layers it
shares with another image included: an over-estimate of the disk, never an under-estimate.
Before a pull, the registry's manifest says the compressed size of the image's layers; an image
whose compressed size alone exceeds the budget is IMAGE_TOO_LARGE at once, without pulling, and
that size is the room made before the pull. After the pull the real size is known: the cache
evicts again if needed, and an image that alone exceeds the budget is removed again and
reported IMAGE_TOO_LARGE.

Concurrent requests for one image share one pull; a failed pull answers all its waiters with
one precise reason, is retried (with backoff) only when the failure is transient, and answers
new requests for `image_pull_failure_memory_s` without asking the registry again, so no number
of waiters can turn into a retry storm.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import platform
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog
import tenacity

from swerl.chassis.images import image_key
from swerl.exec import metrics
from swerl.exec.errors import DockerUnavailable
from swerl.exec.runtime import ContainerRuntime, PullProgress, RuntimeApiError
from swerl.exec.settings import ExecSettings
from swerl.exec.store import NodeStore

# Fork images (ForkSandbox/CheckpointSandbox) carry this label: they take room in the budget, but
# only the fork manager removes them (when no checkpoint or sandbox needs them).
FORK_IMAGE_LABEL = "swerl.checkpoint_id"

log = structlog.get_logger(__name__)

# ImagePullResult reasons, and the ones a later attempt of the same pull can cure.
REGISTRY_UNREACHABLE = "REGISTRY_UNREACHABLE"
PULL_FAILED = "PULL_FAILED"
TRANSIENT_REASONS = frozenset({REGISTRY_UNREACHABLE, PULL_FAILED})

# No new attempt of a failed pull starts later than this after its first.
PULL_RETRY_WINDOW_S = 120.0
# How long the node waits for a registry's manifest before pulling without knowing the size.
MANIFEST_TIMEOUT_S = 5.0
_MANIFEST_TYPES = ", ".join(
    [
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
    ]
)
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), "amd64")


@dataclass(frozen=True)
class EnsureOutcome:
    """What became of one requested image: PRESENT, PULLED or FAILED with a reason."""

    status: str
    reason: str = ""
    message: str = ""
    size_bytes: int = 0
    # Images this pull evicted to make room (their first tag, else their id).
    evicted: tuple[str, ...] = ()


@dataclass(frozen=True)
class CachedImage:
    """An image on the node's dockerd with what the cache knows of it."""

    image_id: str
    repo_tags: list[str]
    size_bytes: int
    create_time: float
    last_use_time: float  # 0 when the node never pulled nor used it
    use_count: int
    pinned: bool
    in_use_count: int  # sandboxes (running, spare or being created) made from it
    cached: bool  # counted against the budget (pulled or used by the node)
    checkpoint_id: str = ""  # set on a fork image: the checkpoint it holds


@dataclass(frozen=True)
class CacheUsage:
    budget_bytes: int  # 0 = unlimited
    used_bytes: int
    cached_images: int


class PullFailure(Exception):
    """One attempt of a pull failed; `reason` is the ImagePullResult reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass
class _Pull:
    task: asyncio.Task[EnsureOutcome]
    listeners: set[Callable[[PullProgress], None]] = field(default_factory=set)


def split_reference(image: str) -> tuple[str, str | None]:
    """("repo", "tag") for pulling; a digest stays in the repository part."""
    if "@" in image:
        return image, None
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon + 1 :]
    return image, "latest"


def classify_pull_error(text: str) -> str:
    """The ImagePullResult reason for dockerd's error text of a failed pull."""
    lowered = text.lower()
    unreachable = (
        "dial tcp",
        "no such host",
        "connection refused",
        "i/o timeout",
        "tls handshake",
        "network is unreachable",
        "context deadline exceeded",
    )
    auth = ("no basic auth credentials", "unauthorized", "authentication required", "forbidden")
    if any(s in lowered for s in unreachable):
        reason = "REGISTRY_UNREACHABLE"
    elif "pull access denied" in lowered:
        # Docker Hub answers a missing repository like a private one ("pull access denied ...
        # repository does not exist or may require 'docker login'"): without credentials the
        # node cannot tell them apart, and "not found" is the common case.
        reason = "IMAGE_NOT_FOUND"
    elif any(s in lowered for s in auth) or "denied:" in lowered:
        reason = "REGISTRY_AUTH"
    elif any(s in lowered for s in ("not found", "manifest unknown", "name unknown")):
        reason = "IMAGE_NOT_FOUND"
    else:
        reason = "PULL_FAILED"
    return reason


def _split(reference: str) -> tuple[str, str, str]:
    """(registry host, repository path, tag or digest) of a reference, Docker's way."""
    name, at, digest = reference.partition("@")
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        host, path = first, rest
    else:
        host, path = "registry-1.docker.io", name if rest else "library/" + name
    slash = path.rfind("/")
    colon = path.rfind(":")
    tag = "latest"
    if colon > slash:
        path, tag = path[:colon], path[colon + 1 :]
    return host, path, digest if at else tag


def registry_size(reference: str) -> int | None:
    """Compressed bytes of an image's layers and config as its registry's manifest says, for
    this node's platform; None when the registry does not say (unreachable, private, odd)."""
    host, path, ref = _split(reference)
    loopback = host.split(":")[0] in ("localhost", "127.0.0.1", "[::1]")
    base = f"{'http' if loopback else 'https'}://{host}/v2/{path}/manifests/"
    token: str | None = None

    def fetch(url: str) -> dict[str, Any]:
        nonlocal token
        for _ in range(2):
            headers = {"Accept": _MANIFEST_TYPES}
            if token:
                headers["Authorization"] = f"Bearer {token}"
            try:
                request = urllib.request.Request(url, headers=headers)
                with urllib.request.urlopen(request, timeout=MANIFEST_TIMEOUT_S) as response:
                    return dict(json.load(response))
            except urllib.error.HTTPError as exc:
                challenge = exc.headers.get("WWW-Authenticate", "")
                if exc.code != 401 or token is not None or not challenge.startswith("Bearer "):
                    raise
                token = _anonymous_token(challenge)
        raise PermissionError("registry refused an anonymous token")

    try:
        manifest = fetch(base + ref)
        if "manifests" in manifest:  # an index: the entry for this node's platform
            entry = next(
                m
                for m in manifest["manifests"]
                if (m.get("platform") or {}).get("architecture") == _ARCH
                and (m.get("platform") or {}).get("os", "linux") == "linux"
            )
            manifest = fetch(base + entry["digest"])
        layers = manifest.get("layers") or []
        config = manifest.get("config") or {}
        return int(sum(int(layer.get("size", 0)) for layer in layers) + int(config.get("size", 0)))
    except (OSError, ValueError, KeyError, StopIteration, TypeError):
        return None


def _anonymous_token(challenge: str) -> str:
    """Docker's token flow without credentials (public images on Docker Hub and the like)."""
    fields = dict(
        part.split("=", 1) for part in challenge[len("Bearer ") :].split(",") if "=" in part
    )
    fields = {k.strip(): v.strip().strip('"') for k, v in fields.items()}
    realm = fields.pop("realm")
    url = realm + "?" + urllib.parse.urlencode(fields)
    with urllib.request.urlopen(url, timeout=MANIFEST_TIMEOUT_S) as response:
        body = json.load(response)
    return str(body.get("token") or body.get("access_token"))


class ImageCache:
    """The node's images: presence, on-demand shared pulls, LRU eviction within the budget.

    `in_use` returns the image references of the node's sandboxes (running, spare or being
    created), one entry per sandbox.
    """

    def __init__(
        self,
        settings: ExecSettings,
        backend: ContainerRuntime,
        store: NodeStore,
        in_use: Callable[[], Iterable[str]],
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.store = store
        self._in_use = in_use
        self.budget = settings.image_disk_budget
        self.pinned = {image_key(r) for r in [settings.base_image, *settings.pinned_images]}
        self._pulls: dict[str, _Pull] = {}
        self._failures: dict[str, tuple[float, EnsureOutcome]] = {}
        # Bytes set aside for pulls under way (their estimated size), by image.
        self._reserved: dict[str, int] = {}
        # Budget decisions (room making, trimming) one at a time; pulls themselves run freely.
        self._budget_lock = asyncio.Lock()

    # -- queries --------------------------------------------------------------------------
    async def listing(self) -> list[CachedImage]:
        rows = await self.backend.list_images()
        uses = self.store.image_uses()
        in_use = self._in_use_by_id(rows)
        return [
            CachedImage(
                image_id=row["Id"],
                repo_tags=_tags(row),
                size_bytes=int(row.get("Size", 0) or 0),
                create_time=float(row.get("Created", 0) or 0),
                last_use_time=uses[row["Id"]].last_use if row["Id"] in uses else 0.0,
                use_count=uses[row["Id"]].use_count if row["Id"] in uses else 0,
                pinned=self._is_pinned(row),
                in_use_count=in_use[row["Id"]],
                cached=row["Id"] in uses and not self._is_pinned(row),
                checkpoint_id=(row.get("Labels") or {}).get(FORK_IMAGE_LABEL, ""),
            )
            for row in rows
        ]

    async def usage(self) -> CacheUsage:
        rows = await self.backend.list_images()
        uses = self.store.image_uses()
        cached = [r for r in rows if r["Id"] in uses and not self._is_pinned(r)]
        used = sum(int(r.get("Size", 0) or 0) for r in cached) + _fork_bytes(rows)
        metrics.IMAGE_BUDGET_USED.set(used)
        return CacheUsage(self.budget, used, len(cached))

    def _is_pinned(self, row: dict[str, Any]) -> bool:
        return row["Id"] in self.pinned or any(image_key(t) in self.pinned for t in _names(row))

    def _in_use_by_id(self, rows: list[dict[str, Any]], also: Iterable[str] = ()) -> Counter[str]:
        """Image id -> sandboxes using it (plus one for each reference in `also`)."""
        ids = {image_key(name): row["Id"] for row in rows for name in _names(row)}
        ids.update({row["Id"]: row["Id"] for row in rows})
        counts: Counter[str] = Counter()
        for reference in [*self._in_use(), *also]:
            image_id = ids.get(image_key(reference))
            if image_id is not None:
                counts[image_id] += 1
        return counts

    # -- use ------------------------------------------------------------------------------
    def mark_used(self, image_id: str) -> None:
        """A sandbox was created from the image: it becomes the most recently used."""
        self.store.touch_image(image_id, time.time(), used=True)

    # -- ensure ---------------------------------------------------------------------------
    async def ensure(
        self, image: str, mirror_prefix: str, on_progress: Callable[[PullProgress], None]
    ) -> EnsureOutcome:
        """Makes `image` present, joining the pull already under way for it if there is one."""
        if await self.backend.inspect_image(image) is not None:
            metrics.IMAGE_HITS.inc()
            return EnsureOutcome("PRESENT")
        metrics.IMAGE_MISSES.inc()
        remembered = self._failures.get(image)
        if remembered is not None:
            failed_at, outcome = remembered
            if time.monotonic() - failed_at < self.settings.image_pull_failure_memory_s:
                return outcome
            del self._failures[image]
        pull = self._pulls.get(image)
        if pull is None:
            # The pull runs to its end even if every waiter goes away: the next one finds the
            # image present instead of starting over.
            task = asyncio.get_running_loop().create_task(self._pull(image, mirror_prefix))
            pull = self._pulls[image] = _Pull(task)
            task.add_done_callback(lambda _: self._pulls.pop(image, None))
        pull.listeners.add(on_progress)
        try:
            return await asyncio.shield(pull.task)
        finally:
            pull.listeners.discard(on_progress)

    async def _pull(self, image: str, mirror_prefix: str) -> EnsureOutcome:
        source = mirror_prefix.rstrip("/") + "/" + image if mirror_prefix else image
        try:
            outcome = await self._pull_within_budget(image, source)
        except PullFailure as exc:
            outcome = EnsureOutcome("FAILED", reason=exc.reason, message=exc.message)
        except DockerUnavailable as exc:
            outcome = EnsureOutcome("FAILED", reason="PULL_FAILED", message=exc.message)
        except Exception as exc:  # never leave waiters without an answer
            log.exception("image.pull_crashed", image=image)
            outcome = EnsureOutcome("FAILED", reason="PULL_FAILED", message=f"pull failed: {exc}")
        finally:
            self._reserved.pop(image, None)
        metrics.IMAGE_PULLS.labels(outcome.reason or outcome.status).inc()
        if outcome.status == "FAILED":
            self._failures[image] = (time.monotonic(), outcome)
            log.warning("image.pull_failed", image=image, reason=outcome.reason)
        return outcome

    async def _pull_within_budget(self, image: str, source: str) -> EnsureOutcome:
        evicted: list[str] = []
        if self.budget:
            estimate = await asyncio.to_thread(registry_size, source)
            if estimate is not None and estimate > self.budget:
                return EnsureOutcome(
                    "FAILED",
                    reason="IMAGE_TOO_LARGE",
                    message=f"{image} is {estimate} bytes compressed; the node's image budget is"
                    f" {self.budget} bytes",
                    size_bytes=estimate,
                )
            async with self._budget_lock:
                room = await self._make_room(estimate or 0, evicted)
                if not room:
                    return self._cache_full(image, evicted)
                self._reserved[image] = estimate or 0
        await self._pull_with_retries(image, source)
        info = await self.backend.inspect_image(image)
        if info is None:
            return EnsureOutcome(
                "FAILED", reason="PULL_FAILED", message=f"{image} is absent after its pull"
            )
        size = int(info.get("Size", 0) or 0)
        metrics.IMAGE_PULLED_BYTES.inc(size)
        self.store.touch_image(info["Id"], time.time(), used=False)
        if self.budget:
            self._reserved.pop(image, None)
            if size > self.budget:
                with contextlib.suppress(RuntimeApiError):
                    await self._remove(info["Id"], _tags({"RepoTags": info.get("RepoTags")}))
                self.store.forget_image(info["Id"])
                return EnsureOutcome(
                    "FAILED",
                    reason="IMAGE_TOO_LARGE",
                    message=f"{image} is {size} bytes unpacked; the node's image budget is"
                    f" {self.budget} bytes",
                    size_bytes=size,
                    evicted=tuple(evicted),
                )
            async with self._budget_lock:
                if not await self._make_room(0, evicted, protect={info["Id"]}):
                    # The estimate let the pull start, its real size does not fit, and what
                    # else is cached is in use: the budget wins over the image just pulled.
                    with contextlib.suppress(RuntimeApiError):
                        await self._remove(info["Id"], _tags({"RepoTags": info.get("RepoTags")}))
                    self.store.forget_image(info["Id"])
                    return self._cache_full(image, evicted)
        log.info("image.pulled", image=image, size_bytes=size, evicted=evicted)
        return EnsureOutcome("PULLED", size_bytes=size, evicted=tuple(evicted))

    def _cache_full(self, image: str, evicted: list[str]) -> EnsureOutcome:
        return EnsureOutcome(
            "FAILED",
            reason="IMAGE_CACHE_FULL",
            message=f"no room for {image}: the cached images within the budget of"
            f" {self.budget} bytes are all in use or pinned",
            evicted=tuple(evicted),
        )

    async def _pull_with_retries(self, image: str, source: str) -> None:
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(
                lambda exc: isinstance(exc, PullFailure) and exc.reason in TRANSIENT_REASONS
            ),
            wait=_backoff(self.settings.image_pull_retry_wait_s, max_s=30.0),
            stop=tenacity.stop_after_attempt(self.settings.image_pull_attempts)
            | tenacity.stop_after_delay(PULL_RETRY_WINDOW_S),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                await self._pull_once(image, source)

    async def _pull_once(self, image: str, source: str) -> None:
        repository, tag = split_reference(source)
        loop = asyncio.get_running_loop()

        def broadcast(progress: PullProgress) -> None:
            pull = self._pulls.get(image)
            for listener in list(pull.listeners if pull else ()):
                listener(progress)

        def progressed(progress: PullProgress) -> None:  # on the runtime's worker thread
            loop.call_soon_threadsafe(broadcast, progress)

        try:
            await self.backend.pull(repository, tag, progressed)
            if source != image:
                target_repo, target_tag = split_reference(image)
                await self.backend.tag_image(source, target_repo, target_tag)
        except RuntimeApiError as exc:
            text = str(exc)
            failure = PullFailure(classify_pull_error(text), text[-1000:])
            metrics.IMAGE_PULL_ATTEMPT_FAILURES.labels(failure.reason).inc()
            raise failure from None

    # -- eviction -------------------------------------------------------------------------
    async def _make_room(
        self, need_bytes: int, evicted: list[str], protect: set[str] | None = None
    ) -> bool:
        """Evicts LRU unused unpinned cached images until `need_bytes` more fit; False if they
        cannot. Runs under the budget lock."""
        rows = await self.backend.list_images()
        uses = self.store.image_uses()
        present = {row["Id"] for row in rows}
        for gone in uses.keys() - present:  # removed behind the node's back
            self.store.forget_image(gone)
        cached = [r for r in rows if r["Id"] in uses and not self._is_pinned(r)]
        used = (
            sum(int(r.get("Size", 0) or 0) for r in cached)
            + _fork_bytes(rows)
            + sum(self._reserved.values())
        )
        if used + need_bytes <= self.budget:
            metrics.IMAGE_BUDGET_USED.set(used)
            return True
        # An image whose pull is under way is never evicted, not even between the end of its
        # download and its waiters' answer.
        in_use = self._in_use_by_id(rows, also=list(self._pulls))
        candidates = sorted(
            (r for r in cached if not in_use[r["Id"]] and r["Id"] not in (protect or set())),
            key=lambda r: uses[r["Id"]].last_use,
        )
        for row in candidates:
            if used + need_bytes <= self.budget:
                break
            name = (_tags(row) or [row["Id"]])[0]
            try:
                await self._remove(row["Id"], _tags(row))
            except RuntimeApiError as exc:
                # A container outside swerl's view still uses it (Docker's 409): keep it.
                log.warning("image.evict_refused", image=name, error=str(exc)[-300:])
                continue
            self.store.forget_image(row["Id"])
            used -= int(row.get("Size", 0) or 0)
            evicted.append(name)
            metrics.IMAGE_EVICTIONS.inc()
            log.info("image.evicted", image=name, image_id=row["Id"], last_use=uses[row["Id"]])
        metrics.IMAGE_BUDGET_USED.set(used)
        return used + need_bytes <= self.budget

    async def _remove(self, image_id: str, tags: list[str]) -> None:
        # Docker refuses to remove by id an image with several names without force; untagging
        # all but the last name first leaves one name, and the removal by id stays unforced.
        for tag in tags[1:]:
            await self.backend.remove_image(tag)
        await self.backend.remove_image(image_id)


def _backoff(initial_s: float, *, max_s: float) -> tenacity.wait.wait_base:
    # As swerl.chassis.retry (which imports grpc, so not here): tenacity 9.1 renamed `initial`
    # to `multiplier`; jitter keeps the nodes that failed together from retrying together.
    parameters = inspect.signature(tenacity.wait_exponential_jitter).parameters
    scale = "multiplier" if "multiplier" in parameters else "initial"
    return tenacity.wait_exponential_jitter(**{scale: initial_s}, max=max_s, jitter=initial_s)


def _fork_bytes(rows: list[dict[str, Any]]) -> int:
    """Bytes of the fork images among `rows` (counted against the budget, never evicted)."""
    return sum(
        int(r.get("Size", 0) or 0) for r in rows if FORK_IMAGE_LABEL in (r.get("Labels") or {})
    )


def _tags(row: dict[str, Any]) -> list[str]:
    return [t for t in row.get("RepoTags") or [] if t != "<none>:<none>"]


def _names(row: dict[str, Any]) -> list[str]:
    digests = [d for d in row.get("RepoDigests") or [] if not d.startswith("<none>")]
    return [*_tags(row), *digests]
