"""The bundled example tasks, graded as SWE-bench grades them, on the real dockerd.

Each task loads; its image builds and holds base_commit; in a fresh container, the test patch
plus the gold patch pass every FAIL_TO_PASS and PASS_TO_PASS test, the test patch alone fails
every FAIL_TO_PASS test, and a wrong patch breaks the PASS_TO_PASS tests it names. The loader's
refusals of malformed tasks are checked without Docker.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import uuid
from dataclasses import replace
from pathlib import Path

import docker
import pytest

from swerl.tasks import (
    REQUIRED_KEYS,
    TaskFormatError,
    TaskImageError,
    TaskInstance,
    build_images,
    default_tasks_dir,
    load_tasks,
)

# The bundled set itself, whatever SWERL_TASKS_DIR says. Loading is pure file reading, and the
# per-task tests are parametrized by instance id.
BUNDLED_TASKS_DIR = Path(__file__).resolve().parents[2] / "examples" / "tasks"
TASKS = load_tasks(BUNDLED_TASKS_DIR)
BY_ID = {task.instance_id: task for task in TASKS}
WITH_WRONG_PATCH = [task for task in TASKS if task.wrong_patch is not None]
RUN_TIMEOUT_S = 120

# pytest -rA short summary: "PASSED tests/x.py::t", "FAILED tests/x.py::t - AssertionError".
SUMMARY_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)")
APPLIED_MARK = ">>> patches applied"


def parse_pytest_summary(output: str) -> dict[str, str]:
    statuses: dict[str, str] = {}
    for line in output.splitlines():
        match = SUMMARY_LINE.match(line)
        if match:
            statuses[match.group(2)] = match.group(1)
    return statuses


def run_eval(task: TaskInstance, *patches: str) -> dict[str, str]:
    """Apply ``patches`` with git apply in a fresh container, run the eval script, parse it."""
    steps = ["set -e", "cd /testbed"]
    for number, patch in enumerate(patches):
        steps.append(f"echo {_b64(patch)} | base64 -d > /tmp/{number}.patch")
        steps.append(f"git apply /tmp/{number}.patch")
    steps += [
        f"echo {_b64(task.eval_script)} | base64 -d > /tmp/eval.sh",
        f"echo '{APPLIED_MARK}'",
        "set +e",
        "bash /tmp/eval.sh",
    ]
    done = subprocess.run(
        ["docker", "run", "--rm", "-i", "--network", "none", task.image_name, "bash", "-s"],
        input="\n".join(steps) + "\n",
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert APPLIED_MARK in done.stdout, f"patches did not apply:\n{done.stdout}\n{done.stderr}"
    statuses = parse_pytest_summary(done.stdout)
    assert statuses, f"no pytest summary lines in the output:\n{done.stdout}\n{done.stderr}"
    return statuses


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def not_passed(statuses: dict[str, str], tests: list[str]) -> dict[str, str]:
    return {test: statuses.get(test, "MISSING") for test in tests if statuses.get(test) != "PASSED"}


@pytest.fixture(scope="session")
def task_images(base_image: str) -> dict:
    # Rebuilt (from the layer cache, so quickly) so that the images match the files on disk.
    return build_images(TASKS, base_image=base_image, rebuild=True, progress=lambda line: None)


# ---------------------------------------------------------------------------- the bundled set


def test_bundled_set_has_at_least_six_tasks_in_swe_bench_shape():
    assert len(TASKS) >= 6
    for task in TASKS:
        assert set(REQUIRED_KEYS) <= set(task.instance)
        assert re.fullmatch(r"swerl-examples__[a-z]+-\d+", task.instance_id)
        assert (
            task.instance["repo"]
            == "swerl-examples/" + task.instance_id.split("__")[1].rsplit("-", 1)[0]
        )
        assert task.image_name == f"swerl-examples/{task.instance_id.lower()}:latest"
        assert task.instance["environment_setup_commit"] == task.base_commit
        assert task.instance["eval_type"] == task.instance["log_parser"] == "pytest"
        assert task.instance["hints_text"] == ""
        assert task.pass_to_pass, task.instance_id
        assert not set(task.fail_to_pass) & set(task.pass_to_pass), task.instance_id


def test_eval_script_runs_pytest_on_every_listed_test_file():
    for task in TASKS:
        files = {test.split("::")[0] for test in task.fail_to_pass + task.pass_to_pass}
        command = task.eval_script.strip().splitlines()[-1].split()
        assert command[:4] == ["python3", "-m", "pytest", "-rA"], task.instance_id
        assert set(command[4:]) == files, task.instance_id
        assert "git apply" not in task.eval_script


def test_patch_files_are_the_patches_in_instance_json():
    for task in TASKS:
        assert (task.directory / "gold.patch").read_text() == task.instance["patch"]
        assert (task.directory / "test.patch").read_text() == task.instance["test_patch"]
        if task.wrong_patch is not None:
            assert (task.directory / "wrong.patch").read_text() == task.instance["wrong_patch"]


def test_bundled_set_covers_new_files_binary_patches_and_wrong_patches():
    assert any("new file mode" in task.gold_patch for task in TASKS)
    assert any("GIT binary patch" in task.gold_patch for task in TASKS)
    assert any(task.gold_patch.count("diff --git ") >= 2 for task in TASKS)
    assert any(task.gold_patch.count("\n+") - task.gold_patch.count("\n+++") == 1 for task in TASKS)
    assert WITH_WRONG_PATCH
    for task in WITH_WRONG_PATCH:
        assert task.wrong_patch_breaks
        assert set(task.wrong_patch_breaks) <= set(task.pass_to_pass)


# ---------------------------------------------------------------------------- the loader


def test_default_tasks_dir_is_the_bundled_set_unless_overridden(monkeypatch, tmp_path):
    monkeypatch.delenv("SWERL_TASKS_DIR", raising=False)
    assert default_tasks_dir() == BUNDLED_TASKS_DIR
    monkeypatch.setenv("SWERL_TASKS_DIR", str(tmp_path))
    assert default_tasks_dir() == tmp_path


def _copy_task(tmp_path: Path, instance_id: str = "swerl-examples__listutils-14") -> Path:
    destination = tmp_path / "tasks" / instance_id
    shutil.copytree(BY_ID[instance_id].directory, destination)
    return destination


def _edit_instance(directory: Path, **changes) -> None:
    path = directory / "instance.json"
    instance = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            instance.pop(key, None)
        else:
            instance[key] = value
    path.write_text(json.dumps(instance))


def test_loader_reads_a_copied_task_like_the_original(tmp_path):
    directory = _copy_task(tmp_path)
    (loaded,) = load_tasks(directory.parent)
    original = BY_ID[directory.name]
    assert loaded.instance == original.instance
    assert loaded.gold_patch == original.gold_patch
    assert loaded.wrong_patch is None


def test_loader_accepts_test_lists_stored_as_json_text_as_swe_bench_datasets_do(tmp_path):
    directory = _copy_task(tmp_path)
    original = BY_ID[directory.name]
    _edit_instance(directory, FAIL_TO_PASS=json.dumps(original.fail_to_pass))
    (loaded,) = load_tasks(directory.parent)
    assert loaded.fail_to_pass == original.fail_to_pass


def test_loader_names_the_file_and_every_missing_key(tmp_path):
    directory = _copy_task(tmp_path)
    _edit_instance(directory, base_commit=None, PASS_TO_PASS=None)
    with pytest.raises(TaskFormatError) as info:
        load_tasks(directory.parent)
    message = str(info.value)
    assert str(directory / "instance.json") in message
    assert "base_commit" in message and "PASS_TO_PASS" in message
    assert "\n" not in message


def test_loader_accepts_a_classic_swe_bench_row_without_eval_script_or_image_name(tmp_path):
    directory = _copy_task(tmp_path)
    original = BY_ID[directory.name]
    _edit_instance(
        directory,
        eval_script=None,
        image_name=None,
        eval_type=None,
        log_parser=None,
        FAIL_TO_PASS=json.dumps(original.fail_to_pass),
        PASS_TO_PASS=json.dumps(original.pass_to_pass),
    )
    (loaded,) = load_tasks(directory.parent)
    assert loaded.eval_script == ""
    assert loaded.fail_to_pass == original.fail_to_pass
    # The image SWE-bench publishes for the instance, by its naming rule.
    assert loaded.image_name == (
        "docker.io/swebench/sweb.eval.x86_64.swerl-examples_1776_listutils-14:latest"
    )


def test_loader_rejects_an_eval_script_that_is_not_a_string(tmp_path):
    directory = _copy_task(tmp_path)
    _edit_instance(directory, eval_script=["pytest"])
    with pytest.raises(TaskFormatError, match=r"instance\.json: 'eval_script' must be a string"):
        load_tasks(directory.parent)


def test_loader_rejects_invalid_json(tmp_path):
    directory = _copy_task(tmp_path)
    (directory / "instance.json").write_text("{not json")
    with pytest.raises(TaskFormatError, match=r"instance\.json: not valid JSON"):
        load_tasks(directory.parent)


def test_loader_rejects_a_directory_without_instance_json(tmp_path):
    directory = _copy_task(tmp_path)
    (directory / "instance.json").unlink()
    with pytest.raises(TaskFormatError, match=r"instance\.json: missing"):
        load_tasks(directory.parent)


def test_loader_rejects_a_patch_file_that_differs_from_instance_json(tmp_path):
    directory = _copy_task(tmp_path)
    (directory / "gold.patch").write_text("diff --git a/x b/x\n")
    with pytest.raises(TaskFormatError, match=r"gold\.patch: differs from 'patch'"):
        load_tasks(directory.parent)


def test_loader_rejects_a_directory_named_differently_from_its_instance(tmp_path):
    directory = _copy_task(tmp_path)
    directory.rename(directory.with_name("renamed"))
    with pytest.raises(TaskFormatError, match="differs from its directory name"):
        load_tasks(directory.parent)


def test_loader_rejects_test_lists_that_are_not_lists_of_strings(tmp_path):
    directory = _copy_task(tmp_path)
    _edit_instance(directory, PASS_TO_PASS=[1, 2])
    with pytest.raises(TaskFormatError, match="'PASS_TO_PASS' must be a list"):
        load_tasks(directory.parent)


def test_loader_rejects_a_short_base_commit(tmp_path):
    directory = _copy_task(tmp_path)
    _edit_instance(directory, base_commit="abc123")
    with pytest.raises(TaskFormatError, match="full 40-hex commit hash"):
        load_tasks(directory.parent)


def test_loader_rejects_wrong_patch_breaks_outside_pass_to_pass(tmp_path):
    directory = _copy_task(tmp_path, WITH_WRONG_PATCH[0].instance_id)
    _edit_instance(directory, wrong_patch_breaks=["tests/test_nope.py::test_nope"])
    with pytest.raises(TaskFormatError, match="not in PASS_TO_PASS"):
        load_tasks(directory.parent)


@pytest.mark.docker
def test_a_task_without_dockerfile_loads_and_building_its_absent_image_is_one_line(tmp_path):
    # A published image needs no Dockerfile; only an image that must be built does.
    directory = _copy_task(tmp_path)
    (directory / "Dockerfile").unlink()
    (task,) = load_tasks(directory.parent)
    assert task.dockerfile is None
    absent = replace(task, image_name="swerl-test/never-built-here:latest")
    with pytest.raises(TaskImageError) as info:
        build_images([absent], base_image="swerl-base:bookworm", progress=lambda _line: None)
    message = str(info.value)
    assert str(directory / "instance.json") in message and "\n" not in message
    assert "swerl-test/never-built-here:latest is not present" in message


def test_loader_rejects_a_missing_tasks_directory(tmp_path):
    with pytest.raises(TaskFormatError, match="SWERL_TASKS_DIR"):
        load_tasks(tmp_path / "absent")


# ---------------------------------------------------------------------------- images


@pytest.mark.docker
@pytest.mark.parametrize("instance_id", sorted(BY_ID))
def test_image_holds_a_clean_checkout_of_base_commit(task_images, instance_id):
    task = BY_ID[instance_id]
    assert task_images[instance_id].labels["swerl.task"] == instance_id
    script = "git rev-parse HEAD && git status --porcelain && git rev-list --count HEAD"
    done = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", task.image_name, "bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=True,
    )
    assert done.stdout.split() == [task.base_commit, "1"]


@pytest.mark.docker
def test_build_images_keeps_present_images_unless_rebuild(task_images, base_image):
    lines: list[str] = []
    images = build_images(TASKS, base_image=base_image, progress=lines.append)
    assert len(lines) == len(TASKS)
    assert all(line.endswith("present, not rebuilt") for line in lines)
    assert {key: image.id for key, image in images.items()} == {
        key: image.id for key, image in task_images.items()
    }


@pytest.fixture
def scratch_image_name():
    name = f"swerl-test/tasks-{uuid.uuid4().hex[:10]}:latest"
    yield name
    client = docker.from_env()
    try:
        client.images.remove(name, force=True)
    except docker.errors.ImageNotFound:
        pass
    finally:
        client.close()


@pytest.mark.docker
def test_build_images_refuses_an_image_whose_head_is_not_base_commit(
    tmp_path, base_image, scratch_image_name
):
    directory = _copy_task(tmp_path)
    _edit_instance(directory, base_commit="0" * 40, image_name=scratch_image_name)
    lines: list[str] = []
    with pytest.raises(TaskImageError, match=f"neither base_commit {'0' * 40}") as info:
        build_images(load_tasks(directory.parent), base_image=base_image, progress=lines.append)
    assert lines and "built in" in lines[0]
    assert "swerl tasks build --rebuild" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.docker
def test_build_images_accepts_the_official_layout_one_setup_commit_above_base(
    tmp_path, base_image, scratch_image_name
):
    # SWE-bench's images commit their environment setup on top of base_commit.
    directory = _copy_task(tmp_path)
    _edit_instance(directory, image_name=scratch_image_name)
    dockerfile = directory / "Dockerfile"
    dockerfile.write_text(
        dockerfile.read_text() + "RUN git -c user.name=setup -c user.email=setup@swerl.invalid"
        " commit -q --allow-empty -m 'environment setup'\n"
    )
    (task,) = load_tasks(directory.parent)
    images = build_images([task], base_image=base_image, progress=lambda _: None)
    assert task.instance_id in images
    head = docker.from_env().containers.run(
        scratch_image_name, ["git", "rev-parse", "HEAD~1"], working_dir="/testbed", remove=True
    )
    assert head.decode().strip() == task.base_commit


@pytest.mark.docker
def test_build_images_reports_a_failing_build_with_its_log(
    tmp_path, base_image, scratch_image_name
):
    directory = _copy_task(tmp_path)
    _edit_instance(directory, image_name=scratch_image_name)
    dockerfile = directory / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "RUN echo about to fail && false\n")
    with pytest.raises(TaskImageError) as info:
        build_images(load_tasks(directory.parent), base_image=base_image, progress=lambda _: None)
    assert str(dockerfile) in str(info.value)
    assert "about to fail" in str(info.value)


# ---------------------------------------------------------------------------- grading


@pytest.mark.docker
@pytest.mark.parametrize("instance_id", sorted(BY_ID))
def test_gold_patch_passes_every_fail_to_pass_and_pass_to_pass_test(task_images, instance_id):
    task = BY_ID[instance_id]
    statuses = run_eval(task, task.test_patch, task.gold_patch)
    assert not_passed(statuses, task.fail_to_pass + task.pass_to_pass) == {}


@pytest.mark.docker
@pytest.mark.parametrize("instance_id", sorted(BY_ID))
def test_test_patch_alone_fails_every_fail_to_pass_test(task_images, instance_id):
    task = BY_ID[instance_id]
    statuses = run_eval(task, task.test_patch)
    # Each one ran and failed (FAILED, or ERROR in a fixture); none merely went missing.
    outcomes = {test: statuses.get(test, "MISSING") for test in task.fail_to_pass}
    assert set(outcomes.values()) <= {"FAILED", "ERROR"}, outcomes
    assert not_passed(statuses, task.pass_to_pass) == {}


@pytest.mark.docker
@pytest.mark.parametrize("instance_id", sorted(task.instance_id for task in WITH_WRONG_PATCH))
def test_wrong_patch_passes_fail_to_pass_but_breaks_the_named_tests(task_images, instance_id):
    task = BY_ID[instance_id]
    assert task.wrong_patch is not None
    statuses = run_eval(task, task.test_patch, task.wrong_patch)
    assert not_passed(statuses, task.fail_to_pass) == {}
    broken = not_passed(statuses, task.pass_to_pass)
    assert sorted(broken) == sorted(task.wrong_patch_breaks)
    assert set(broken.values()) <= {"FAILED", "ERROR"}
