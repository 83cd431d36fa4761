"""Task instances in SWE-bench format, read from a directory or a rows file, and their images.

A tasks directory holds one subdirectory per instance, named after its ``instance_id``:
``instance.json`` (the SWE-bench row as published, optionally with ``image_name`` and
``eval_script``), optionally a ``Dockerfile`` that builds the repository at ``base_commit`` into
``/testbed`` from ``${BASE_IMAGE}`` (without one the image must be on the node already, as a
published image is), and the patches as files (``gold.patch``, ``test.patch``, optionally
``wrong.patch``). A rows file (SWE-bench / SWE-Gym rows as published: parquet, JSON or JSON
lines, read as ``swerl eval`` reads them) gives tasks whose images are named as published and
never built here (``load_task_source``). A row without ``eval_script`` is a classic SWE-bench
row: Evaluate runs the script swebench builds for its ``repo``/``version``. A row without
``image_name`` runs in the image its dataset publishes (swerl.data.naming: SWE-bench's rule in a
tasks directory; a rows file's ``--image-convention``). The bundled set lives in the
repository's ``examples/tasks``; ``examples/tasks/README.md`` describes the format.

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

from swerl.data.naming import derived_image_name, is_image_reference

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
    # The task directory; None for a task read from a rows file.
    directory: Path | None
    image_name: str
    gold_patch: str = field(repr=False)
    test_patch: str = field(repr=False)
    wrong_patch: str | None = field(default=None, repr=False)
    # Where a row-file task came from, "<file>: row <n> (<instance_id>)", for messages.
    origin: str = ""

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
    def dockerfile(self) -> Path | None:
        """The Dockerfile that builds the image; None when there is none (a published image)."""
        if self.directory is None or not (self.directory / DOCKERFILE).is_file():
            return None
        return self.directory / DOCKERFILE

    @property
    def where(self) -> str:
        """The task's instance.json, or its row in a rows file, for messages."""
        if self.directory is None:
            return self.origin
        return str(self.directory / INSTANCE_FILE)


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
    instance.json, a directory named differently from its instance id. A Dockerfile is needed
    only to build an image that is not present (build_images says so then).
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
        instance["image_name"] = derived_image_name(instance["instance_id"], "swe-bench")
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
    return TaskInstance(
        instance=instance,
        directory=directory,
        image_name=instance["image_name"],
        gold_patch=patches["patch"] or "",
        test_patch=patches["test_patch"] or "",
        wrong_patch=patches["wrong_patch"],
    )


def load_task_source(
    source: Path, *, convention: str = "auto", registry_prefix: str = ""
) -> list[TaskInstance]:
    """The tasks of a tasks directory (load_tasks) or of a rows file.

    Rows are read, checked and named exactly as `swerl eval` reads them
    (swerl.data.rows.load_rows_file: parquet, JSON, JSON lines, a saved dataset; test
    lists as JSON text or lists; with or without eval_script; an explicit image_name wins, else
    the image is named by `convention`'s rule). Any row that cannot be graded, or has no gold
    patch, is a TaskFormatError naming the file, the row and the field.
    """
    source = Path(source)
    if source.is_dir() and not (source / "dataset_info.json").exists():
        return load_tasks(source)
    from swerl.data.rows import load_rows_file

    if not source.exists():
        raise TaskFormatError(f"{source}: no such file or directory")
    try:
        loaded = load_rows_file(source, convention=convention, registry_prefix=registry_prefix)
    except ValueError as exc:  # an unreadable file: DataSourceError, a line that is not JSON
        raise TaskFormatError(" ".join(str(exc).split())) from None
    if loaded.skipped:
        counts = ", ".join(f"{reason} {n}" for reason, n in sorted(loaded.skipped.items()))
        raise TaskFormatError(f"{loaded.first_problem} ({counts} rows cannot be graded)")
    if not loaded.instances:
        raise TaskFormatError(f"{source}: no rows in it")
    tasks = []
    for index, loaded_instance in enumerate(loaded.instances):
        instance = dict(loaded_instance.instance)
        origin = f"{source}: row {index} ({instance['instance_id']})"
        gold = instance.get("patch")
        if not isinstance(gold, str) or not gold.strip():
            raise TaskFormatError(f"{origin}: patch (the gold patch) is empty or absent")
        wrong = instance.get("wrong_patch")
        tasks.append(
            TaskInstance(
                instance=instance,
                directory=None,
                image_name=instance["image_name"],
                gold_patch=gold,
                test_patch=instance["test_patch"],
                wrong_patch=wrong if isinstance(wrong, str) and wrong.strip() else None,
                origin=origin,
            )
        )
    return tasks


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
    HEAD of /testbed, and TaskImageError says which one does not. A task without a Dockerfile
    (a published image, a row of a rows file) is never built: its image must be present.
    """
    import docker as docker_sdk

    client = docker_client or docker_sdk.from_env()
    try:
        images: dict[str, Image] = {}
        for number, task in enumerate(tasks, start=1):
            label = f"[{number}/{len(tasks)}] {task.image_name}"
            buildable = task.dockerfile is not None
            image = None if rebuild and buildable else _present(client, task.image_name)
            if image is None and not buildable:
                raise TaskImageError(
                    f"{task.where}: image {task.image_name} is not present on this node and the"
                    f" task has no Dockerfile to build it from; pull it first"
                    f" (docker pull {task.image_name})"
                )
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


def require_images(
    tasks: Sequence[TaskInstance], *, docker_client: docker.DockerClient | None = None
) -> None:
    """Raises TaskImageError, in one line naming the first task's row and image, unless the
    local dockerd has every task's image (nothing is built or pulled)."""
    import docker as docker_sdk

    client = docker_client or docker_sdk.from_env()
    try:
        missing = [task for task in tasks if _present(client, task.image_name) is None]
    finally:
        if docker_client is None:
            client.close()
    if missing:
        raise images_missing(missing, "this node")


def images_missing(missing: list[TaskInstance], where: str) -> TaskImageError:
    """One line naming the first task (its row) whose image `where` lacks, and how many more."""
    first = missing[0]
    more = f" (and {len(missing) - 1} more tasks' images)" if len(missing) > 1 else ""
    return TaskImageError(
        f"{first.where}: image {first.image_name} is not present on {where}{more};"
        f" pull it there first (swerl images pull, or docker pull {first.image_name})"
    )


def _present(client: docker.DockerClient, name: str) -> Image | None:
    import docker as docker_sdk

    try:
        return client.images.get(name)
    except docker_sdk.errors.ImageNotFound:
        return None


def _build(client: docker.DockerClient, task: TaskInstance, base_image: str) -> Image:
    import docker as docker_sdk

    assert task.directory is not None and task.dockerfile is not None  # build_images checked

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


# A git object id: SHA-1 (40 hex digits) or SHA-256 (64).
_COMMIT_ID = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def _check_base_commit(client: docker.DockerClient, task: TaskInstance, image: Image) -> None:
    """/testbed must be at base_commit, or one commit above it as SWE-bench's images are.

    The official images commit their environment setup on top of base_commit; an image whose
    HEAD is neither base_commit nor a child of it holds some other tree.
    """
    import docker as docker_sdk

    script = "git rev-parse HEAD && (git rev-parse -q --verify HEAD~1 || true)"
    commits: list[str] = []
    try:
        for attempt in range(3):
            try:
                output = client.containers.run(
                    image.id,
                    ["sh", "-c", script],
                    working_dir="/testbed",
                    network_disabled=True,
                    remove=True,
                )
            except docker_sdk.errors.APIError as exc:
                # Podman's service may fail to inspect a container in the moment its process
                # exits ("read /proc/N/cgroup: no such process"): the run is tried again.
                if attempt == 2 or "no such process" not in str(exc):
                    raise
                continue
            commits = bytes(output).decode(errors="replace").split()
            # Under load Podman's service has answered such a run with words of an error
            # instead of its output (`:"no ...`, seen in CI): only commit ids are an answer.
            if commits and all(_COMMIT_ID.fullmatch(c) for c in commits):
                break
            if attempt == 2:
                raise TaskImageError(
                    f"{task.image_name}: `git rev-parse HEAD` in /testbed answered "
                    f"{bytes(output).decode(errors='replace')[:200]!r}, not a commit id"
                )
    except docker_sdk.errors.ContainerError as exc:
        stderr = exc.stderr.decode(errors="replace").strip() if exc.stderr else ""
        raise TaskImageError(
            f"{task.image_name}: `git rev-parse HEAD` failed in /testbed: {stderr}"
        ) from exc
    head, parent = [*commits, "", ""][:2]
    if task.base_commit not in (head, parent):
        remedy = (
            "rebuild the image (`swerl tasks build --rebuild`)"
            if task.dockerfile is not None
            else "use the image published for this row"
        )
        raise TaskImageError(
            f"{task.image_name}: /testbed is at {head or '(no commit)'}, which is neither "
            f"base_commit {task.base_commit} of {task.where} nor one commit "
            f"above it; {remedy} or correct base_commit"
        )
