"""`swerl eval` as a user runs it (a subprocess), on the bundled tasks with the replay policy,
over an in-process pool, exec node and agent on the real dockerd."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import docker
import pytest

from swerl.tasks import build_images, default_tasks_dir, load_tasks

TASKS = default_tasks_dir()
ALL = sorted(t.instance_id for t in load_tasks(TASKS))

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module", autouse=True)
def task_images():
    base = os.environ.get("SWERL_BASE_IMAGE", "swerl-base:bookworm")
    build_images(load_tasks(TASKS), base_image=base, progress=lambda line: None)


def _eval(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swerl.cli", "eval", str(TASKS), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
    )


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def _sandboxes_of(prefix: str) -> list:
    client = docker.from_env()
    try:
        # The low-level list inspects nothing, so containers of other tests vanishing meanwhile
        # cannot fail it.
        return [
            c["Id"]
            for c in client.api.containers(all=True, filters={"label": "swerl.node"})
            if (c.get("Labels") or {}).get("swerl.node", "").startswith(prefix)
        ]
    finally:
        client.close()


def test_eval_writes_results_preds_and_summary_and_resumes_without_redoing(tmp_path):
    out = tmp_path / "run"
    first = _eval("--replay", "gold", "-o", str(out), "-j", "3", "--slice", "0:3")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "3 instances selected, 0 already done" in first.stdout
    done_first = {r["instance_id"]: r["episode_id"] for r in _records(out)}
    assert sorted(done_first) == ALL[:3]

    second = _eval("--replay", "gold", "-o", str(out), "-j", "3")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "6 instances selected, 3 already done" in second.stdout
    records = _records(out)
    assert len(records) == 6 and sorted(r["instance_id"] for r in records) == ALL
    # The first three were not run again.
    assert {r["instance_id"]: r["episode_id"] for r in records[:3]} == done_first
    assert all(r["status"] == "SUBMITTED" and r["resolved"] for r in records)
    assert all(r["reward"] == 1.0 and r["eval_status"] == "RESOLVED_FULL" for r in records)
    # progress line on stderr
    assert "6/6 done" not in second.stderr and "3/3 done | 3 resolved | 0 errors" in second.stderr

    preds = [json.loads(line) for line in (out / "preds.jsonl").read_text().splitlines()]
    assert sorted(p["instance_id"] for p in preds) == ALL
    assert all(p["model_name_or_path"] == "replay" for p in preds)
    assert all(p["model_patch"].startswith("diff --git") for p in preds)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["instances"] == 6 and summary["resolved"] == 6
    assert summary["resolve_rate"] == 1.0 and summary["errors"] == 0
    assert summary["by_status"] == {"SUBMITTED": 6}
    assert summary["by_eval_status"] == {"RESOLVED_FULL": 6}
    assert summary["metrics_mean"]["turns"] > 0

    # Per-instance artifacts from the agent.
    for record in records:
        artifact = Path(record["artifact_dir"])
        assert artifact.parent == (out / "artifacts").resolve()
        assert {"traj.json", "patch.diff", "meta.json"} <= {p.name for p in artifact.iterdir()}

    third = _eval("--replay", "gold", "-o", str(out))
    assert third.returncode == 0 and "0 to run" in third.stdout
    assert len(_records(out)) == 6


def test_unresolved_answers_and_infra_errors_are_counted_apart_and_errors_retried(tmp_path):
    out = tmp_path / "run"
    ids = ["swerl-examples__romans-5", "swerl-examples__semverlite-41"]
    # A policy nobody serves: the agent ends the episode INFRA_ERROR, which is not scored (after
    # retrying the refused connection for 1 s here: the agent's setting, 60 s by default).
    broken = _eval(
        "--policy-url",
        "http://127.0.0.1:9",
        "-o",
        str(out),
        "--instance-ids",
        *ids,
        SWERL_AGENT_POLICY_CONNECT_MAX_DELAY_S="1",
    )
    assert broken.returncode == 1
    assert "errors are not scored" in broken.stdout
    records = _records(out)
    assert [r["status"] for r in records] == ["INFRA_ERROR", "INFRA_ERROR"]
    assert all(r["error_reason"] and not r["resolved"] for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["errors"] == 2 and summary["completed"] == 0 and summary["resolved"] == 0
    assert (out / "preds.jsonl").read_text() == ""  # no answer, no prediction

    # Without the flag errors stay as they are; with it they run again (a wrong fix this time).
    again = _eval("--replay", "wrong", "-o", str(out), "--instance-ids", ids[1])
    assert "1 already done" in again.stdout and "0 to run" in again.stdout
    retried = _eval("--replay", "wrong", "-o", str(out), "--instance-ids", ids[1], "--retry-errors")
    assert retried.returncode == 0, retried.stdout + retried.stderr
    latest = _records(out)[-1]
    assert latest["instance_id"] == ids[1]
    assert latest["status"] == "SUBMITTED" and latest["reward"] == -1.0
    assert not latest["resolved"] and latest["eval_status"] != "RESOLVED_FULL"
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["instances"], summary["resolved"], summary["errors"]) == (1, 0, 0)
    assert summary["completed"] == 1 and summary["resolve_rate"] == 0.0


def test_sigint_leaves_no_sandbox_and_a_resumable_output_dir(tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "swerl.cli",
        "eval",
        str(TASKS),
        "--replay",
        "gold",
        "--replay-latency",
        "1.5",
        "-o",
        str(out),
        "-j",
        "2",
        "--slice",
        "0:4",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    prefix = f"eval-{process.pid}-"
    try:
        # Interrupt once one episode is recorded and others hold sandboxes.
        results = out / "results.jsonl"
        deadline = time.monotonic() + 180
        while not (results.exists() and results.read_text() and _sandboxes_of(prefix)):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no episode finished while others ran"
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
            # (swerl eval writes every thread's stack 30 s into a shutdown that hangs)
            pytest.fail(f"swerl eval still running 60 s after SIGINT:\n{stderr[-12000:]}")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, stdout + stderr
    assert "interrupted; run the same command again to resume" in stderr
    assert _sandboxes_of(prefix) == []
    finished = results.read_text().splitlines()
    assert 1 <= len(finished) < 4
    assert all(json.loads(line)["status"] == "SUBMITTED" for line in finished)

    resumed = _eval("--replay", "gold", "-o", str(out), "-j", "2", "--slice", "0:4")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"{len(finished)} already done in " in resumed.stdout
    assert f", {4 - len(finished)} to run" in resumed.stdout
    records = _records(out)
    assert sorted(r["instance_id"] for r in records) == ALL[:4]
    assert all(r["resolved"] for r in records)


def test_harness_names_who_drives_the_episodes(tmp_path):
    (one,) = [i for i in ALL if "romans" in i]
    flags = ["--replay", "gold", "--instance-ids", one, "-j", "1"]
    named = _eval(*flags, "--harness", "builtin", "-o", str(tmp_path / "builtin"))
    assert named.returncode == 0, named.stderr[-2000:]
    (record,) = _records(tmp_path / "builtin")
    assert record["status"] == "SUBMITTED" and record["resolved"] is True
    unknown = _eval(*flags, "--harness", "no-such-harness", "-o", str(tmp_path / "unknown"))
    # The agent refuses the start; eval records the refusal's reason on the row.
    (refused,) = _records(tmp_path / "unknown")
    assert refused["status"] == "INFRA_ERROR", unknown.stderr[-2000:]
    assert refused["error_reason"] == "UNKNOWN_HARNESS"


def test_bad_invocations_exit_2_with_a_reason(tmp_path):
    no_policy = _eval("-o", str(tmp_path / "a"))
    assert no_policy.returncode == 2 and "--policy-url" in no_policy.stderr
    bad_slice = _eval("--replay", "gold", "-o", str(tmp_path / "b"), "--slice", "x")
    assert bad_slice.returncode == 2 and "START:STOP" in bad_slice.stderr
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "swerl.cli",
            "eval",
            str(tmp_path / "nope.jsonl"),
            "-o",
            "x",
            "--policy-url",
            "http://127.0.0.1:9",
        ],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "no such file" in missing.stderr


async def test_eval_uses_running_services_with_agent_or_pool(tmp_path):
    import asyncio

    from swerl.agent.server import local_agent
    from swerl.devservers.replay import ReplayPolicyServer, scripts_for_tasks
    from swerl.stack import local_stack

    tasks = [t for t in load_tasks(TASKS) if t.instance_id in ALL[:2]]
    replay = ReplayPolicyServer(scripts_for_tasks(tasks, "gold"))
    url = await replay.start()
    try:
        async with (
            local_stack(nodes=1, purpose="eval-remote") as stack,
            local_agent(stack.pool_address, stack.token) as agent,
        ):
            common = ["--policy-url", url, "--token", stack.token, "--no-build"]
            via_agent = await asyncio.to_thread(
                _eval,
                "-o",
                str(tmp_path / "a"),
                "--agent",
                agent.address,
                "--slice",
                "0:1",
                *common,
            )
            via_pool = await asyncio.to_thread(
                _eval,
                "-o",
                str(tmp_path / "p"),
                "--pool",
                stack.pool_address,
                "--slice",
                "1:2",
                *common,
            )
    finally:
        await replay.stop()
    assert via_agent.returncode == 0, via_agent.stdout + via_agent.stderr
    assert via_pool.returncode == 0, via_pool.stdout + via_pool.stderr
    (remote,) = _records(tmp_path / "a")
    (pooled,) = _records(tmp_path / "p")
    assert remote["instance_id"] == ALL[0] and remote["resolved"]
    assert remote["artifact_dir"] == ""  # a remote agent writes artifacts only when asked
    assert pooled["instance_id"] == ALL[1] and pooled["resolved"]
    assert await asyncio.to_thread(os.path.isdir, pooled["artifact_dir"])


def test_best_of_n_from_a_shared_start_writes_a_row_per_branch_and_reports_pass_at_n(tmp_path):
    out = tmp_path / "best-of-3"
    ids = ALL[:2]
    args = ("--replay", "gold", "-o", str(out), "--instance-ids", *ids, "-j", "2")
    run = _eval(*args, "--branch-at", "2", "--branches", "3")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "pass@3 2/2 (100.0%), pass@1 estimate 100.0% (branches from turn 2)" in run.stdout
    records = _records(out)
    assert len(records) == 6
    for iid in ids:
        rows = [r for r in records if r["instance_id"] == iid]
        # One episode per instance, its three branches, each with its own seed, each graded.
        assert len({r["episode_id"] for r in rows}) == 1
        assert sorted(r["branch"] for r in rows) == [0, 1, 2]
        assert len({r["sampling_seed"] for r in rows}) == 3
        assert all(r["status"] == "SUBMITTED" and r["resolved"] for r in rows)
        assert all(r["eval_status"] == "RESOLVED_FULL" and r["reward"] == 1.0 for r in rows)
        assert all(r["metrics"]["turns"] == 4.0 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["branches"] == 3 and summary["branch_at"] == 2
    assert summary["pass_at_n"] == 1.0 and summary["pass_at_1"] == 1.0
    assert summary["instances"] == 2 and summary["resolved"] == 2 and summary["errors"] == 0
    preds = [json.loads(line) for line in (out / "preds.jsonl").read_text().splitlines()]
    assert sorted(p["instance_id"] for p in preds) == ids  # one prediction per instance
    # Resumable as a plain run: both instances are done.
    again = _eval(*args, "--branch-at", "2", "--branches", "3")
    assert again.returncode == 0 and "2 already done" in again.stdout
    assert len(_records(out)) == 6


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--branch-at", "2"), "--branch-at needs --branches"),
        (("--branches", "3"), "--branches needs --branch-at"),
        (("--branch-at", "2", "--branches", "1"), "--branches takes 2 to 64"),
        (("--branch-at", "-1", "--branches", "3"), "numbers >= 0"),
        (("--branch-at", "2", "--branches", "-3"), "numbers >= 0"),
        (("--branch-at", "2", "--branches", "65"), "--branches takes 2 to 64"),
        (("--branch-at", "5", "--branches", "2", "--max-turns", "5"), "below --max-turns 5"),
    ],
)
def test_bad_best_of_n_values_exit_2_with_one_line(tmp_path, flags, says):
    bad = _eval("--replay", "gold", "--no-build", "-o", str(tmp_path / "x"), *flags, timeout=60)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("swerl eval: ") and says in lines[0], lines
    assert "Traceback" not in bad.stderr and not (tmp_path / "x").exists()


def _sampled_runs(record: dict) -> list[list[int]]:
    """The runs of mask-1 ids of a token record: what the policy sampled, call by call."""
    runs: list[list[int]] = []
    previous = 0
    for token, mask in zip(record["response_ids"], record["loss_mask"], strict=True):
        if mask and not previous:
            runs.append([])
        if mask:
            runs[-1].append(token)
        previous = mask
    return runs


@pytest.mark.timeout(600)
def test_mini_swe_agent_harness_resolves_the_bundled_tasks_with_exact_token_samples(tmp_path):
    from swerl.chassis.hf import bundled_qwen3_tokenizer_dir, load_tokenizer

    tokenizer = load_tokenizer(bundled_qwen3_tokenizer_dir())
    tasks = {t.instance_id: t for t in load_tasks(TASKS)}
    flags = ["--harness", "mini-swe-agent", "-j", "3"]
    gold = _eval("--replay", "gold", *flags, "-o", str(tmp_path / "gold"), timeout=900)
    assert gold.returncode == 0, gold.stdout + gold.stderr[-2000:]
    records = _records(tmp_path / "gold")
    assert len(records) == 6 and all(r["resolved"] and r["reward"] == 1.0 for r in records)
    for record in records:
        artifact = Path(record["artifact_dir"])
        # mini-swe-agent's trajectory (harness.log) and the trained samples (tokens.json):
        # one chain whose prompt is mini-swe-agent's first request and whose sampled runs
        # are, one by one, the tool calls mini-swe-agent got back and ran.
        trajectory = json.loads((artifact / "harness.log").read_text())
        tokens = json.loads((artifact / "tokens.json").read_text())
        assert tokens["chains"] == [] and tokens["trajectory"] is not None
        chain = tokens["trajectory"]
        prompt = tokenizer.decode(chain["prompt_ids"])
        statement = tasks[record["instance_id"]].instance["problem_statement"]
        assert statement.strip().splitlines()[0] in prompt
        calls = [m for m in trajectory["messages"] if m["role"] == "assistant"]
        runs = _sampled_runs(chain)
        assert len(runs) == len(calls) == record["metrics"]["gateway_calls"] == 5
        for run, call in zip(runs, calls, strict=True):
            text = tokenizer.decode(run)
            (tool_call,) = call["tool_calls"]
            command = json.loads(tool_call["function"]["arguments"])["command"]
            assert json.dumps(command)[1:-1] in text
            assert text.endswith("<|im_end|>")
        assert record["patch"].startswith("diff --git")


@pytest.mark.timeout(900)
def test_mini_swe_agent_harness_wrong_is_minus_one_and_garbage_no_infra_error(tmp_path):
    # Two tasks each (every task through the harness is the gold test above): what a wrong fix
    # and a garbage reply do to a harness episode does not depend on the task.
    flags = ["--harness", "mini-swe-agent", "-j", "2", "--slice", "0:2"]
    wrong = _eval("--replay", "wrong", *flags, "-o", str(tmp_path / "wrong"), timeout=900)
    assert wrong.returncode == 0, wrong.stderr[-2000:]
    assert [r["reward"] for r in _records(tmp_path / "wrong")] == [-1.0] * 2
    garbage = _eval("--replay", "garbage", *flags, "-o", str(tmp_path / "garbage"), timeout=900)
    assert garbage.returncode == 0, garbage.stderr[-2000:]
    ended = _records(tmp_path / "garbage")
    assert len(ended) == 2 and {r["status"] for r in ended} == {"HARNESS_FAILED"}
    assert all(r["error_reason"] == "HARNESS_FAILED" for r in ended)
