"""`swerl inspect` in a real headless chromium, on a run of real episodes (replay policy, real
Qwen3 tokenizer, pool + exec node + agent on the real dockerd)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import urlopen

import pytest
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.expected_conditions import staleness_of
from selenium.webdriver.support.ui import Select, WebDriverWait
from testkit.web import Served, console_errors, save_screenshot

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def inspector(real_run):
    run_dir, _ = real_run
    served = Served("inspect", str(run_dir), "--port", "0")
    yield served
    served.stop()


def _gone(page):
    """staleness_of(page), also when chromedriver reports the old page's node, during the
    navigation, as "does not belong to the document" (a WebDriverException that staleness_of
    does not take for stale; it failed a CI run)."""
    stale = staleness_of(page)

    def check(driver) -> bool:
        try:
            return bool(stale(driver))
        except WebDriverException as err:
            if "does not belong to the document" in str(err):
                return True
            raise

    return check


def _click_and_wait(browser, element) -> None:
    """Clicks a link or button that loads a new page, and waits until the old one is gone."""
    page = browser.find_element(By.TAG_NAME, "main")
    element.click()
    WebDriverWait(browser, 30).until(_gone(page))


def _rows(browser) -> list[dict[str, str]]:
    rows = []
    for tr in browser.find_elements(By.CSS_SELECTOR, "#episodes tr.episode"):
        cells = [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
        rows.append(
            {
                "key": tr.get_attribute("data-key"),
                "instance": cells[0],
                "status": cells[1],
                "reward": cells[2],
                "turns": cells[3],
                "tokens": cells[4],
            }
        )
    return rows


def _meta(run_dir: Path, key: str) -> dict:
    return json.loads((run_dir / key / "meta.json").read_text())


def test_list_shows_every_episode_with_its_status_and_reward(
    inspector, real_run, browser, screenshots
):
    run_dir, _ = real_run
    browser.get(inspector.url + "/")
    rows = _rows(browser)
    assert len(rows) == 8
    assert browser.find_element(By.ID, "match-count").text == "8 matching"
    for row in rows:
        meta = _meta(run_dir, row["key"])
        assert row["status"] == meta["status"] == "SUBMITTED"
        assert float(row["reward"]) == meta["reward"]
        assert int(row["tokens"]) > 0 and int(row["turns"]) > 0
    rewards = sorted(float(r["reward"]) for r in rows)
    assert rewards == [-1.0, -1.0] + [1.0] * 6
    save_screenshot(browser, screenshots / "inspect-list.png")
    assert console_errors(browser) == []


def test_filtering_to_reward_minus_one_shows_only_the_wrong_patch_episodes(
    inspector, real_run, browser, screenshots
):
    browser.get(inspector.url + "/")
    Select(browser.find_element(By.ID, "f-reward")).select_by_value("-1")
    _click_and_wait(browser, browser.find_element(By.ID, "f-apply"))
    rows = _rows(browser)
    assert len(rows) == 2
    assert all("__wrong-" in r["key"] for r in rows)
    assert all(r["reward"] == "-1.0" for r in rows)
    assert "reward=-1" in browser.current_url
    save_screenshot(browser, screenshots / "inspect-filtered.png")
    # sorting keeps the filter
    _click_and_wait(browser, browser.find_element(By.LINK_TEXT, "instance ▲"))
    assert len(_rows(browser)) == 2 and "reward=-1" in browser.current_url
    assert console_errors(browser) == []


def test_search_finds_text_in_actions_and_outputs_only_of_matching_episodes(
    inspector, real_run, browser
):
    run_dir, _ = real_run
    # A word from one episode's command output: the file list of its repository.
    key = sorted(p.name for p in run_dir.iterdir() if "isocodes" in p.name)[0]
    browser.get(inspector.url + "/")
    box = browser.find_element(By.ID, "f-q")
    box.send_keys("currencies.csv")
    _click_and_wait(browser, browser.find_element(By.ID, "f-apply"))
    rows = _rows(browser)
    assert rows and all("isocodes" in r["instance"] for r in rows)
    assert key in {r["key"] for r in rows}
    box = browser.find_element(By.ID, "f-q")
    box.clear()
    box.send_keys("no episode ever printed this 7f3a")
    _click_and_wait(browser, browser.find_element(By.ID, "f-apply"))
    assert _rows(browser) == []
    assert browser.find_element(By.ID, "no-match").is_displayed()


def test_episode_page_shows_problem_turns_patch_and_report_per_test(
    inspector, real_run, browser, screenshots
):
    run_dir, _ = real_run
    key = sorted(p.name for p in run_dir.iterdir() if "__gold-" in p.name)[0]
    meta = _meta(run_dir, key)
    traj = json.loads((run_dir / key / "traj.json").read_text())
    browser.get(inspector.url + "/")
    _click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, f'tr[data-key="{key}"] a'))
    assert browser.current_url.endswith(f"/episode/{key}")
    problem = browser.find_element(By.CSS_SELECTOR, "#problem pre").text
    assert traj["messages"][1]["content"].splitlines()[2] in problem
    turns = browser.find_elements(By.CSS_SELECTOR, "#turns .turn")
    assert len(turns) == len(traj["steps"])
    actions = [t.find_element(By.CSS_SELECTOR, "pre.action").text for t in turns]
    assert actions[0] == traj["steps"][0]["action"]
    adds = browser.find_elements(By.CSS_SELECTOR, "#patch .diff .add")
    assert adds and all(a.text.startswith("+") for a in adds)
    tests = browser.find_elements(By.CSS_SELECTOR, "#tests tr.test")
    report = meta["report"]
    expected = sum(len(v) for g in ("failToPass", "passToPass") for v in report[g].values())
    assert len(tests) == expected
    groups = {t.find_elements(By.TAG_NAME, "td")[0].text for t in tests}
    assert groups == {"FAIL_TO_PASS", "PASS_TO_PASS"}
    save_screenshot(browser, screenshots / "inspect-episode.png")
    assert console_errors(browser) == []


def test_token_view_of_a_gold_episode_marks_exactly_the_policy_tokens(
    inspector, real_run, browser, screenshots
):
    run_dir, _ = real_run
    key = sorted(p.name for p in run_dir.iterdir() if "__gold-" in p.name)[0]
    record = json.loads((run_dir / key / "tokens.json").read_text())["trajectory"]
    traj = json.loads((run_dir / key / "traj.json").read_text())
    browser.get(f"{inspector.url}/episode/{key}")
    _click_and_wait(browser, browser.find_element(By.ID, "token-view"))
    model = browser.find_elements(By.CSS_SELECTOR, ".tokens.response .tok[data-mask='1']")
    other = browser.find_elements(By.CSS_SELECTOR, ".tokens.response .tok[data-mask='0']")
    prompt = browser.find_elements(By.CSS_SELECTOR, "details.prompt .tok")
    assert len(model) == sum(record["loss_mask"]) > 0
    assert len(other) == len(record["loss_mask"]) - sum(record["loss_mask"]) > 0
    assert len(prompt) == len(record["prompt_ids"])
    # the same tokens in the same order, masks aligned
    shown = [int(t.get_attribute("title").split()[1]) for t in model]
    assert shown == [
        t for t, m in zip(record["response_ids"], record["loss_mask"], strict=True) if m
    ]
    # the logprob of each model token on hover
    first = model[0].get_attribute("title")
    assert f"logprob {record['logprobs'][0]:.4f}" in first
    # one turn marker per policy turn
    markers = browser.find_elements(By.CSS_SELECTOR, ".tokens.response .turn-marker")
    assert len(markers) == len(traj["steps"])
    assert browser.find_element(By.CSS_SELECTOR, ".trained-count").text == str(
        sum(record["loss_mask"])
    )
    # decoded text, not ids: the first turn's response is there
    text = browser.find_element(By.CSS_SELECTOR, ".tokens.response").text
    assert traj["steps"][0]["action"] in text
    save_screenshot(browser, screenshots / "inspect-tokens.png")
    assert console_errors(browser) == []


def test_dynamic_history_episode_shows_one_record_per_turn(real_run, browser, screenshots):
    _, dynamic_dir = real_run
    served = Served("inspect", str(dynamic_dir), "--port", "0")
    try:
        key = next(dynamic_dir.iterdir()).name
        tokens = json.loads((dynamic_dir / key / "tokens.json").read_text())
        assert tokens["trajectory"] is None and tokens["turns"]
        browser.get(f"{served.url}/episode/{key}/tokens")
        records = browser.find_elements(By.CSS_SELECTOR, "section.record")
        assert len(records) == len(tokens["turns"])
        assert records[1].find_element(By.TAG_NAME, "h2").text == "Turn 1 (dynamic history)"
        for section, turn in zip(records, tokens["turns"], strict=True):
            trained = section.find_elements(By.CSS_SELECTOR, ".tok[data-mask='1']")
            assert len(trained) == sum(turn["loss_mask"]) == len(turn["response_ids"])
        # no context was trimmed in this short episode
        assert browser.find_elements(By.CSS_SELECTOR, ".trim-marker") == []
        save_screenshot(browser, screenshots / "inspect-dynamic.png")
    finally:
        served.stop()


def test_unknown_episode_and_bad_query_are_clear_http_errors(inspector):
    for path, code, words in (
        ("/episode/no-such-episode", 404, "no episode 'no-such-episode'"),
        ("/episode/no-such-episode/tokens", 404, "no episode"),
        ("/?page=two", 400, "page must be a whole number"),
        ("/?sort=colour", 400, "unknown sort 'colour'"),
        ("/?reward=high", 400, "reward must be a number"),
    ):
        with pytest.raises(HTTPError) as err:
            urlopen(inspector.url + path, timeout=30)
        assert err.value.code == code
        assert words in err.value.read().decode()


def test_missing_path_and_bad_port_fail_with_a_message(tmp_path):
    def swerl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "swerl.cli", *args], capture_output=True, text=True, timeout=120
        )

    missing = swerl("inspect", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "no such directory" in missing.stderr
    empty = swerl("inspect", str(tmp_path))
    assert empty.returncode == 2 and "not a run" in empty.stderr
    bad = swerl("inspect", str(tmp_path), "--port", "70000")
    assert bad.returncode == 2 and "port out of range" in bad.stderr
    word = swerl("dashboard", "--pool", "127.0.0.1:1", "--port", "http")
    assert word.returncode == 2 and "not a port number" in word.stderr


def test_a_port_in_use_is_reported(real_run):
    run_dir, _ = real_run
    first = Served("inspect", str(run_dir), "--port", "0")
    try:
        port = first.url.rsplit(":", 1)[1]
        second = subprocess.run(
            [sys.executable, "-m", "swerl.cli", "inspect", str(run_dir), "--port", port],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode != 0
        assert f"cannot listen on 127.0.0.1:{port}" in second.stderr
    finally:
        first.stop()


def test_a_run_of_thousands_of_episodes_is_indexed_once_and_paged(
    real_run, tmp_path, browser, screenshots
):
    run_dir, _ = real_run
    source = next(p for p in sorted(run_dir.iterdir()) if "__gold-" in p.name)
    big = tmp_path / "big"
    big.mkdir()
    count = 3000
    for i in range(count):
        folder = big / f"{source.name}-{i:04d}"
        shutil.copytree(source, folder)
        if i % 3 == 0:  # a third of them wrong, to filter on
            meta = json.loads((folder / "meta.json").read_text())
            meta["reward"] = -1.0
            (folder / "meta.json").write_text(json.dumps(meta))
    served = Served("inspect", str(big), "--port", "0")
    try:
        indexed = next(line for line in served.lines if "episodes indexed" in line)
        assert f"{count} episodes indexed" in indexed
        index_s = float(indexed.split(" in ")[1].split()[0])
        print(f"index of {count} episodes built in {index_s:.2f} s")
        started = time.perf_counter()
        with urlopen(served.url + "/?sort=reward&order=desc", timeout=30) as response:
            timing = response.headers["Server-Timing"]
            body = response.read().decode()
        wall = time.perf_counter() - started
        server_ms = float(timing.split("dur=")[1])
        print(f"list page: {server_ms:.1f} ms server time, {wall * 1000:.1f} ms wall")
        assert server_ms < 1000
        assert body.count('class="episode"') == 50
        browser.get(served.url + "/?reward=-1")
        assert browser.find_element(By.ID, "match-count").text == "1000 matching"
        assert browser.find_element(By.ID, "page-of").text == "page 1 of 20"
        _click_and_wait(browser, browser.find_element(By.ID, "next"))
        assert browser.find_element(By.ID, "page-of").text == "page 2 of 20"
        assert "reward=-1" in browser.current_url
        first_page_keys = {
            r.get_attribute("data-key")
            for r in browser.find_elements(By.CSS_SELECTOR, "tr.episode")
        }
        browser.get(served.url + "/?reward=-1&page=20")
        last = browser.find_elements(By.CSS_SELECTOR, "tr.episode")
        assert len(last) == 50 and not first_page_keys & {r.get_attribute("data-key") for r in last}
        assert browser.find_elements(By.ID, "next") == []
        save_screenshot(browser, screenshots / "inspect-3000.png")
    finally:
        served.stop()


def test_an_eval_run_directory_is_read_from_results_even_after_it_moved(
    real_run, tmp_path, browser
):
    run_dir, _ = real_run
    # The layout `swerl eval` writes: results.jsonl (last line per instance wins) + artifacts/,
    # here with artifact_dir paths of a place the run no longer is.
    out = tmp_path / "moved-run"
    (out / "artifacts").mkdir(parents=True)
    lines = []
    for folder in sorted(run_dir.iterdir()):
        if "__gold-" not in folder.name:
            continue
        shutil.copytree(folder, out / "artifacts" / folder.name)
        meta = json.loads((folder / "meta.json").read_text())
        lines.append(
            {
                "instance_id": meta["instance_id"],
                "episode_id": meta["episode_id"],
                "status": meta["status"],
                "reward": meta["reward"],
                "metrics": meta["metrics"],
                "artifact_dir": f"/gone/artifacts/{folder.name}",
                "eval_status": "RESOLVED_FULL",
                "duration_s": 12.5,
            }
        )
    # an instance that failed first and has no artifacts on its last try
    failed = {**lines[0], "episode_id": "retry-1", "status": "INFRA_ERROR", "reward": None}
    failed.update(artifact_dir="", eval_status="", error_reason="LEASE_LOST")
    text = "\n".join(json.dumps(line) for line in [*lines[1:], lines[0], failed])
    (out / "results.jsonl").write_text(text + "\n" + '{"instance_id": "cut sh')
    served = Served("inspect", str(out), "--port", "0")
    try:
        browser.get(served.url + "/?sort=status")
        rows = _rows(browser)
        assert len(rows) == len(lines)
        statuses = [r["status"] for r in rows]
        assert statuses.count("INFRA_ERROR") == 1 and statuses.count("SUBMITTED") == len(lines) - 1
        error_row = next(r for r in rows if r["status"] == "INFRA_ERROR")
        assert error_row["key"] == "retry-1" and error_row["reward"] == "-"
        browser.get(served.url + "/episode/retry-1")
        assert "not graded" in browser.find_element(By.ID, "evaluation").text
        assert browser.find_element(By.ID, "error").text.startswith("LEASE_LOST")
        ok_row = next(r for r in rows if r["status"] == "SUBMITTED")
        browser.get(f"{served.url}/episode/{ok_row['key']}/tokens")
        assert browser.find_elements(By.CSS_SELECTOR, ".tok[data-mask='1']")
    finally:
        served.stop()


def test_format_error_turns_and_prm_scores_are_shown(real_run, tmp_path, browser):
    run_dir, _ = real_run
    source = next(p for p in sorted(run_dir.iterdir()) if "__gold-" in p.name)
    folder = tmp_path / "run" / source.name
    shutil.copytree(source, folder)
    # the same episode as if turn 1 had been a reply without a bash block, and PRM had judged it
    traj = json.loads((folder / "traj.json").read_text())
    traj["steps"][1] = {"turn": 1, "response": "no block here", "format_error": True, "n_blocks": 0}
    (folder / "traj.json").write_text(json.dumps(traj))
    meta = json.loads((folder / "meta.json").read_text())
    meta["step_scores"] = [
        {"turnIndex": 0, "score": 0.5, "validVotes": 3, "state": "STEP_SCORE_STATE_SCORED"},
        {"turnIndex": 1, "state": "STEP_SCORE_STATE_NOT_JUDGED"},
        {"turnIndex": 2, "score": -1.0, "validVotes": 2, "state": "STEP_SCORE_STATE_SCORED"},
    ]
    (folder / "meta.json").write_text(json.dumps(meta))
    served = Served("inspect", str(tmp_path / "run"), "--port", "0")
    try:
        browser.get(served.url + "/")
        assert _rows(browser)[0]["key"] == source.name
        prm_cell = browser.find_elements(By.CSS_SELECTOR, "tr.episode td")[6].text
        assert prm_cell == "-0.25"  # the mean of the SCORED turns only
        browser.get(f"{served.url}/episode/{source.name}")
        turn1 = browser.find_element(By.ID, "turn-1").text
        assert "format error: nothing ran" in turn1 and "NOT_JUDGED" in turn1
        assert "PRM 0.50 (3 votes, SCORED)" in browser.find_element(By.ID, "turn-0").text
        assert console_errors(browser) == []
    finally:
        served.stop()


def test_a_trimmed_turn_is_marked_in_the_whole_episode_token_view(real_run, tmp_path, browser):
    run_dir, _ = real_run
    source = next(p for p in sorted(run_dir.iterdir()) if "__gold-" in p.name)
    folder = tmp_path / "run" / source.name
    shutil.copytree(source, folder)
    # as the agent records it when the window left turns out of turn 2's prompt
    traj = json.loads((folder / "traj.json").read_text())
    traj["steps"][2]["context_trimmed"] = True
    (folder / "traj.json").write_text(json.dumps(traj))
    served = Served("inspect", str(tmp_path / "run"), "--port", "0")
    try:
        browser.get(f"{served.url}/episode/{source.name}/tokens")
        marks = browser.find_elements(By.CSS_SELECTOR, ".tokens.response .trim-marker")
        assert len(marks) == 1 and "turn 2" in marks[0].text
        # right before the T2 mark
        following = marks[0].find_element(By.XPATH, "following-sibling::span[1]")
        assert following.text == "T2"
    finally:
        served.stop()


def test_real_trimmed_episodes_show_where_the_context_was_trimmed(
    trimmed_run, browser, screenshots
):
    served = Served("inspect", str(trimmed_run), "--port", "0")
    try:
        whole = next(p for p in trimmed_run.iterdir() if p.name.endswith("__trim-0"))
        steps = json.loads((whole / "traj.json").read_text())["steps"]
        trimmed_turns = [s["turn"] for s in steps if s.get("context_trimmed")]
        assert trimmed_turns  # the agent recorded the trims
        browser.get(f"{served.url}/episode/{whole.name}/tokens")
        marks = browser.find_elements(By.CSS_SELECTOR, ".tokens.response .trim-marker")
        assert [int(m.text.split("turn ")[1].split()[0]) for m in marks] == trimmed_turns

        dynamic = next(p for p in trimmed_run.iterdir() if p.name.endswith("__trim-1"))
        turns = json.loads((dynamic / "tokens.json").read_text())["turns"]
        browser.get(f"{served.url}/episode/{dynamic.name}/tokens")
        sections = browser.find_elements(By.CSS_SELECTOR, "section.record")
        assert len(sections) == len(turns) == 12
        flagged = [
            i for i, s in enumerate(sections) if s.find_elements(By.CSS_SELECTOR, ".trim-marker")
        ]
        # a turn is flagged exactly when its prompt does not extend the previous prompt + response
        expected = [
            i
            for i in range(1, len(turns))
            if turns[i]["prompt_ids"][
                : len(turns[i - 1]["prompt_ids"]) + len(turns[i - 1]["response_ids"])
            ]
            != turns[i - 1]["prompt_ids"] + turns[i - 1]["response_ids"]
        ]
        assert flagged == expected and flagged
        browser.execute_script("arguments[0].scrollIntoView()", sections[flagged[0]])
        save_screenshot(browser, screenshots / "inspect-trimmed.png")
    finally:
        served.stop()
