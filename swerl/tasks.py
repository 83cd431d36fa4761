"""Task instances in SWE-bench format, read from a directory, and the Docker images they run in.

A tasks directory holds one subdirectory per instance, named after its ``instance_id``:
``instance.json`` (the SWE-bench row as published, optionally with ``image_name`` and
``eval_script``), a ``Dockerfile`` that builds the repository at ``base_commit`` into ``/testbed``
from ``${BASE_IMAGE}``, and the patches as files (``gold.patch``, ``test.patch``, optionally
``wrong.patch``). A row without ``eval_script`` is a classic SWE-bench row: Evaluate runs the
script swebench builds for its ``repo``/``version``. A row without ``image_name`` runs in the
image its dataset publishes (SWE-bench's naming rule). The bundled set
lives in the repository's ``examples/tasks``; ``examples/tasks/README.md`` describes the format.

Loading needs nothing beyond the standard library; building images needs the Docker SDK (the
``node`` extra), imported only when ``build_images`` runs.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swerl.data.naming import is_image_reference

if TYPE_CHECKING:
    import docker
    from docker.models.images import Image

TASKS_DIR_ENV = "SWERL_TASKS_DIR"
INSTANCE_FILE = "instance.json"
DOCKERFILE = "Dockerfile"

REQUIRED_KEYS = (
    "instance_id",
    "repo",
    "version",
    "base_commit",
    "problem_statement",
    "patch",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
)
# Each patch lives both in instance.json (as in SWE-bench) and as a file that `git apply` and a
# reader can use directly; the two copies must agree.
PATCH_FILES = {"patch": "gold.patch", "test_patch": "test.patch", "wrong_patch": "wrong.patch"}

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_BUILD_LOG_TAIL_LINES = 20


class TaskFormatError(ValueError):
    """A task directory or its instance.json is malformed; the message names the file."""


class TaskImageError(RuntimeError):
    """A task image failed to build, or does not hold the repository at the task's base commit."""


@dataclass(frozen=True)
class TaskInstance:
    """One task: its SWE-bench row, where it lives, the image it runs in and its patches.

    ``instance`` is the row as read from instance.json, except that FAIL_TO_PASS and
    PASS_TO_PASS are always lists (SWE-bench datasets store them as JSON-encoded strings).
    """

    instance: dict[str, Any] = field(repr=False)
    directory: Path
    image_name: str
    gold_patch: str = field(repr=False)
    test_patch: str = field(repr=False)
    wrong_patch: str | None = field(default=None, repr=False)

    @property
    def instance_id(self) -> str:
        return str(self.instance["instance_id"])

    @property
    def base_commit(self) -> str:
        return str(self.instance["base_commit"])

    @property
    def fail_to_pass(self) -> list[str]:
        return list(self.instance["FAIL_TO_PASS"])

    @property
    def pass_to_pass(self) -> list[str]:
        return list(self.instance["PASS_TO_PASS"])

    @property
    def eval_script(self) -> str:
        """The row's own test script; empty for a classic SWE-bench row."""
        return str(self.instance.get("eval_script") or "")

    @property
    def wrong_patch_breaks(self) -> list[str]:
        """PASS_TO_PASS tests that ``wrong_patch`` makes fail (empty without a wrong patch)."""
        return list(self.instance.get("wrong_patch_breaks", []))

    @property
    def dockerfile(self) -> Path:
        return self.directory / DOCKERFILE


def default_tasks_dir() -> Path:
    """``$SWERL_TASKS_DIR`` when set, else the bundled ``examples/tasks`` of this checkout."""
    override = os.environ.get(TASKS_DIR_ENV, "").strip()
    if override:
        return Path(override).expanduser()
    # The package `swerl` is the directory swerl/ of the checkout; examples/ sits beside it.
    return Path(__file__).resolve().parent.parent / "examples" / "tasks"


def load_tasks(root: Path) -> list[TaskInstance]:
    """Every task under ``root`` (one subdirectory each), sorted by instance id.

    Raises TaskFormatError, naming the offending file, for anything a grader could trip over
    later: missing keys, test lists of the wrong shape, patch files that disagree with
    instance.json, a directory named differently from its instance id, a missing Dockerfile.
    """
    root = Path(root)
    if not root.is_dir():
        raise TaskFormatError(
            f"{root}: tasks directory not found (set {TASKS_DIR_ENV} to point elsewhere)"
        )
    tasks = [
        load_task(entry)
        for entry in sorted(root.iterdir())
        if entry.is_dir() and not entry.name.startswith((".", "_"))
    ]
    if not tasks:
        raise TaskFormatError(f"{root}: no task directories in it")
    return tasks


def load_task(directory: Path) -> TaskInstance:
    """The task in ``directory``; see load_tasks for what is checked."""
    path = directory / INSTANCE_FILE
    try:
        instance = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TaskFormatError(f"{path}: missing; every task directory needs one") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TaskFormatError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(instance, dict):
        raise TaskFormatError(f"{path}: expected a JSON object, got {type(instance).__name__}")

    missing = [key for key in REQUIRED_KEYS if key not in instance]
    if missing:
        raise TaskFormatError(f"{path}: missing required keys: {', '.join(missing)}")
    for key in ("instance_id", "repo", "base_commit", "patch"):
        if not isinstance(instance[key], str) or not instance[key].strip():
            raise TaskFormatError(f"{path}: {key!r} must be a non-empty string")
    for key in ("image_name", "eval_script"):
        if not isinstance(instance.get(key, ""), str):
            raise TaskFormatError(f"{path}: {key!r} must be a string when given")
    if not str(instance.get("image_name") or "").strip():
        instance["image_name"] = published_image_name(instance["instance_id"])
    elif not is_image_reference(instance["image_name"]):
        raise TaskFormatError(
            f"{path}: 'image_name' {instance['image_name']!r} is not a Docker image reference"
        )
    if instance["instance_id"] != directory.name:
        raise TaskFormatError(
            f"{path}: instance_id {instance['instance_id']!r} differs from its directory name "
            f"{directory.name!r}"
        )
    if not _COMMIT.match(instance["base_commit"]):
        raise TaskFormatError(
            f"{path}: base_commit must be a full 40-hex commit hash, "
            f"got {instance['base_commit']!r}"
        )
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        instance[key] = _test_ids(path, key, instance[key])
    if not instance["FAIL_TO_PASS"]:
        raise TaskFormatError(f"{path}: FAIL_TO_PASS is empty; a task needs a failing test")

    patches = {key: _patch_text(directory, instance, key) for key in PATCH_FILES}
    if not patches["test_patch"]:
        raise TaskFormatError(f"{path}: 'test_patch' is empty")
    breaks = instance.get("wrong_patch_breaks", [])
    if breaks:
        if patches["wrong_patch"] is None:
            raise TaskFormatError(f"{path}: 'wrong_patch_breaks' given but there is no wrong patch")
        instance["wrong_patch_breaks"] = _test_ids(path, "wrong_patch_breaks", breaks)
        unknown = set(instance["wrong_patch_breaks"]) - set(instance["PASS_TO_PASS"])
        if unknown:
            raise TaskFormatError(
                f"{path}: wrong_patch_breaks names tests not in PASS_TO_PASS: {sorted(unknown)}"
            )
    if not (directory / DOCKERFILE).is_file():
        raise TaskFormatError(f"{directory / DOCKERFILE}: missing; it builds the task image")

    return TaskInstance(
        instance=instance,
        directory=directory,
        image_name=instance["image_name"],
        gold_patch=patches["patch"] or "",
        test_patch=patches["test_patch"] or "",
        wrong_patch=patches["wrong_patch"],
    )


def published_image_name(instance_id: str) -> str:
    """SWE-bench's image for an instance: `__` becomes `_1776_`, lower-cased, tag `latest`."""
    name = "docker.io/swebench/sweb.eval.x86_64." + instance_id.replace("__", "_1776_")
    return name.lower() + ":latest"


def _test_ids(path: Path, key: str, value: Any) -> list[str]:
    if isinstance(value, str):
        # SWE-bench datasets store the test lists as JSON text.
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise TaskFormatError(f"{path}: {key!r} is a string but not a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise TaskFormatError(f"{path}: {key!r} must be a list of pytest node ids (strings)")
    return value


def _patch_text(directory: Path, instance: dict[str, Any], key: str) -> str | None:
    """The patch under ``key``, from instance.json and/or its file, which must agree."""
    file = directory / PATCH_FILES[key]
    in_json = instance.get(key)
    on_disk = file.read_text(encoding="utf-8") if file.is_file() else None
    if in_json is not None and not isinstance(in_json, str):
        raise TaskFormatError(f"{directory / INSTANCE_FILE}: {key!r} must be a string")
    if in_json is not None and on_disk is not None and in_json != on_disk:
        raise TaskFormatError(
            f"{file}: differs from {key!r} in {directory / INSTANCE_FILE}; keep the two identical"
        )
    return in_json if in_json is not None else on_disk


def build_images(
    tasks: Sequence[TaskInstance],
    *,
    base_image: str,
    docker_client: docker.DockerClient | None = None,
    rebuild: bool = False,
    progress: Callable[[str], None] = print,
) -> dict[str, Image]:
    """Build (or find) each task's image, tagged ``image_name``; map instance id to image.

    ``base_image`` is passed as the build argument BASE_IMAGE. An image already present is
    kept unless ``rebuild``; built or kept, every image is checked to hold ``base_commit`` at
    HEAD of /testbed, and TaskImageError says which one does not.
    """
    import docker as docker_sdk

    client = docker_client or docker_sdk.from_env()
    try:
        images: dict[str, Image] = {}
        for number, task in enumerate(tasks, start=1):
            label = f"[{number}/{len(tasks)}] {task.image_name}"
            image = None if rebuild else _present(client, task.image_name)
            if image is not None:
                progress(f"{label}: present, not rebuilt")
            else:
                started = time.monotonic()
                image = _build(client, task, base_image)
                progress(f"{label}: built in {time.monotonic() - started:.1f} s")
            _check_base_commit(client, task, image)
            images[task.instance_id] = image
        return images
    finally:
        if docker_client is None:
            client.close()


def _present(client: docker.DockerClient, name: str) -> Image | None:
    import docker as docker_sdk

    try:
        return client.images.get(name)
    except docker_sdk.errors.ImageNotFound:
        return None


def _build(client: docker.DockerClient, task: TaskInstance, base_image: str) -> Image:
    import docker as docker_sdk

    try:
        image, _log = client.images.build(
            path=str(task.directory),
            dockerfile=DOCKERFILE,
            tag=task.image_name,
            buildargs={"BASE_IMAGE": base_image},
            labels={"swerl.task": task.instance_id},
            pull=False,
            rm=True,
            forcerm=True,
        )
    except docker_sdk.errors.BuildError as exc:
        lines = "".join(str(entry.get("stream", entry.get("error", ""))) for entry in exc.build_log)
        tail = "\n".join(lines.rstrip().splitlines()[-_BUILD_LOG_TAIL_LINES:])
        raise TaskImageError(
            f"building {task.image_name} from {task.dockerfile} "
            f"(BASE_IMAGE={base_image}) failed: {exc.msg}\n{tail}"
        ) from exc
    except docker_sdk.errors.APIError as exc:
        raise TaskImageError(
            f"building {task.image_name} from {task.dockerfile} failed: {exc.explanation or exc}"
        ) from exc
    return image


def _check_base_commit(client: docker.DockerClient, task: TaskInstance, image: Image) -> None:
    """/testbed must be at base_commit, or one commit above it as SWE-bench's images are.

    The official images commit their environment setup on top of base_commit; an image whose
    HEAD is neither base_commit nor a child of it holds some other tree.
    """
    import docker as docker_sdk

    try:
        output = client.containers.run(
            image.id,
            ["sh", "-c", "git rev-parse HEAD && (git rev-parse -q --verify HEAD~1 || true)"],
            working_dir="/testbed",
            network_disabled=True,
            remove=True,
        )
    except docker_sdk.errors.ContainerError as exc:
        stderr = exc.stderr.decode(errors="replace").strip() if exc.stderr else ""
        raise TaskImageError(
            f"{task.image_name}: `git rev-parse HEAD` failed in /testbed: {stderr}"
        ) from exc
    commits: list[str] = bytes(output).decode().split()
    head, parent = [*commits, "", ""][:2]
    if task.base_commit not in (head, parent):
        raise TaskImageError(
            f"{task.image_name}: /testbed is at {head or '(no commit)'}, which is neither "
            f"base_commit {task.base_commit} of {task.directory / INSTANCE_FILE} nor one commit "
            "above it; rebuild the image (`swerl tasks build --rebuild`) or correct base_commit"
        )
