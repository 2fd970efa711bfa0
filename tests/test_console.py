"""The web console at ``/ui`` in a real browser: Debian's chromium, driven by
Playwright (``executable_path``; no browser is downloaded), against
``dagnats dev`` (its own process, free ports, a temporary data directory, an
API token) and the scripted agent of ``tests/workers/console_worker.py`` in
worker processes of the test's own.

1. The runs list shows a run started from the page within a second of the
   start's answer, and its status as it changes; a bad JSON input sends
   nothing; the filters narrow the live list.
2. A step's journal page shows records as they are written, tokens streaming
   live and then replaced by the committed model record, the unsafe tool's
   result ``interrupted`` with its partial output after the worker was
   SIGKILLed inside it, the successor's claim fencing the killed holder's, an
   abandoned stream marked; the run page's journal check is sound.
3. A steer input submitted from the page goes queued → placed → done on
   screen; a queued one withdrawn shows withdrawn.
4. Without a token the page asks for one and the API refuses; a wrong token
   is refused with a clear message; a run is cancelled from its page (on a
   phone-sized screen, with nothing wider than the screen), its child run
   with it.

Each test saves screenshots under its temporary directory and prints their
paths. One ``dagnats dev``, one agent process and one browser serve the
module.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, Page, Request, async_playwright, expect

from dagnats.sdk import Worker
from tests.helpers import wait_for
from tests.matrix import lines, reap
from tests.stack import DevProcess, start_dev
from tests.test_approvals import approval_worker
from tests.test_builds import Build
from tests.workers.console_worker import FAILING, PARTIAL, REPLY, words

TOKEN = "console-token-7f3a"
CHROMIUM = Path("/usr/bin/chromium")
LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WORKER = Path(__file__).parent / "workers" / "console_worker.py"
WORKFLOW, TASK = "console-agent", "console-task"
JOURNAL_WORKFLOW, JOURNAL_TASK = "console-journal", "console-journal-task"
PARENT_WORKFLOW = "console-parent"
WAIT = 15_000  # ms: the deadline of a condition that takes a worker's turn or two


def loop(name: str, task: str) -> dict[str, Any]:
    step = {"id": "agent", "type": "agent_loop", "task": task, "agent_loop": {"max_iterations": 5}}
    return {"name": name, "steps": [step]}


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevProcess]:
    root = tmp_path_factory.mktemp("console-dev")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGNATS_")}
    # A two-second lease: the killed worker's task goes to its successor soon.
    env |= {"DAGNATS_API_TOKEN": TOKEN, "DAGNATS_TASK_ACK_WAIT": "2"}
    process = start_dev(root / "data", "--no-demo", env=env, stderr=root / "dev.stderr")
    try:
        with httpx.Client(base_url=process.gateway, headers=_bearer(), timeout=30) as http:
            for document in (
                loop(WORKFLOW, TASK),
                loop(JOURNAL_WORKFLOW, JOURNAL_TASK),
                {
                    "name": PARENT_WORKFLOW,
                    "steps": [{"id": "child", "type": "sub_workflow", "workflow": WORKFLOW}],
                },
            ):
                assert http.post("/workflows", json=document).status_code == 200
        yield process
    finally:
        process.proc.terminate()
        process.proc.communicate(timeout=30)
    problems = (root / "dev.stderr").read_text()
    assert "Traceback" not in problems and "Exception in ASGI" not in problems, problems


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("console-agent")


def spawn_agent(dev: DevProcess, task: str, state: Path) -> subprocess.Popen[bytes]:
    log = (state / f"{task}.log").open("ab")
    with log:
        return subprocess.Popen(
            [sys.executable, str(WORKER), dev.engine, task, str(state)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )


async def ready(proc: subprocess.Popen[bytes], state: Path) -> None:
    await wait_for(
        lambda: (state / f"ready-{proc.pid}").exists() or proc.poll() is not None, timeout=30
    )
    assert proc.poll() is None, "the agent process ended; see its log in " + str(state)


@pytest.fixture(scope="module")
async def agent(dev: DevProcess, state: Path) -> AsyncIterator[subprocess.Popen[bytes]]:
    proc = spawn_agent(dev, TASK, state)
    try:
        await ready(proc, state)
        yield proc
    finally:
        reap(proc)


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(
            f"the console's browser tests need Debian's chromium at {CHROMIUM}: "
            "run `make setup` as root, or `apt-get install chromium`"
        )
    async with async_playwright() as pw:
        found = await pw.chromium.launch(
            executable_path=str(CHROMIUM), args=LAUNCH_ARGS, headless=True
        )
        try:
            yield found
        finally:
            await found.close()


@pytest.fixture
async def page(browser: Browser, dev: DevProcess) -> AsyncIterator[Page]:
    """A tab that has the API token, as after the prompt."""
    context = await browser.new_context(
        base_url=dev.gateway, viewport={"width": 1280, "height": 900}
    )
    await context.add_init_script(f"sessionStorage.setItem('dagnats.api-token', '{TOKEN}')")
    tab = await context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda err: errors.append(str(err)))
    try:
        yield tab
    finally:
        await context.close()
    assert errors == [], errors


@pytest.fixture
async def http(dev: DevProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=dev.gateway, headers=_bearer(), timeout=30) as client:
        yield client


def _bearer() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


async def shot(page: Page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


async def release(state: Path, run_id: str, gate: str) -> None:
    """Let the agent go on from ``gate`` once it stopped there."""
    fifo = state / f"{run_id}.{gate}"
    await wait_for(fifo.exists, timeout=WAIT / 1000, message=f"the agent at {gate}")
    await asyncio.to_thread(fifo.write_bytes, b"go")


async def start(http: httpx.AsyncClient, workflow: str, script: str) -> str:
    response = await http.post("/runs", json={"workflow": workflow, "input": {"script": script}})
    assert response.status_code == 201, response.text
    run_id: str = response.json()["run_id"]
    return run_id


# ---- 1. the runs list ---------------------------------------------------------------


async def test_the_runs_list_shows_a_new_run_within_a_second_and_its_status_live(
    page: Page, http: httpx.AsyncClient, agent: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    await page.goto("/ui/")
    await expect(page.locator("#runs-live")).to_have_attribute("data-state", "live")
    await page.select_option("#filter-workflow", WORKFLOW)
    await expect(page).to_have_url(re.compile(rf"/ui/#/runs\?workflow={WORKFLOW}$"))
    await expect(page.locator("#runs-live")).to_have_attribute("data-state", "live")
    await expect(page.locator(f'#start-workflow option[value="{WORKFLOW}"]')).to_be_attached()
    await page.select_option("#start-workflow", WORKFLOW)

    posts: list[Request] = []
    page.on("request", lambda r: posts.append(r) if r.method == "POST" else None)
    await page.fill("#start-input", '{"script": "wait"')
    await page.click("#start-run")
    await expect(page.locator("#start-msg")).to_contain_text("not valid JSON")
    await expect(page.locator("#start-msg")).to_contain_text("Nothing was sent")
    assert posts == [], "a bad JSON input must not be sent"

    await page.fill("#start-input", '{"script": "wait"}')
    async with page.expect_response(lambda r: r.request.method == "POST") as answer:
        await page.click("#start-run")
    started = await (await answer.value).json()
    since = time.monotonic()
    row = page.locator(f'#runs-body tr[data-run-id="{started["run_id"]}"]')
    # The product's claim: a run is on the list within a second of its start.
    await expect(row).to_be_visible(timeout=1000)
    print(f"the new run was listed {1000 * (time.monotonic() - since):.0f} ms after the start")
    await expect(row.locator(".status")).to_have_text("running")
    await expect(row.locator(".steps")).to_contain_text("waiting", timeout=WAIT)
    await expect(page.locator("#runs-body tr")).to_have_count(1)  # only this workflow's

    submitted = await http.post(
        f"/runs/{started['run_id']}/steps/agent/inputs",
        json={"request_id": "go", "mode": "steer", "content": "go on"},
    )
    assert submitted.status_code == 201, submitted.text
    await expect(row.locator(".status")).to_have_text("completed", timeout=WAIT)
    await expect(row.locator(".steps")).to_contain_text("completed")
    await shot(page, tmp_path, "runs-list")

    # A live list of running runs only: a run enters it, then leaves when it ends.
    await page.select_option("#filter-status", "running")
    await expect(page.locator("#runs-live")).to_have_attribute("data-state", "live")
    await expect(row).to_have_count(0)
    other = await start(http, WORKFLOW, "wait")
    second = page.locator(f'#runs-body tr[data-run-id="{other}"]')
    await expect(second).to_be_visible(timeout=WAIT)
    await http.post(f"/runs/{other}/cancel", json={})
    await expect(second).to_have_count(0, timeout=WAIT)
    await expect(page.locator("#runs-empty")).to_be_visible()


# ---- 2. a step's journal ------------------------------------------------------------


async def test_the_journal_shows_records_live_tokens_and_an_interrupted_unsafe_tool(
    page: Page, http: httpx.AsyncClient, dev: DevProcess, state: Path, tmp_path: Path
) -> None:
    holder = spawn_agent(dev, JOURNAL_TASK, state)
    successor = None
    try:
        await ready(holder, state)
        run_id = await start(http, JOURNAL_WORKFLOW, "journal")
        await page.goto(f"/ui/#/runs/{run_id}/steps/agent")
        timeline = page.locator("#timeline")
        claims = timeline.locator("li.k-claim")
        await expect(page.locator("#tokens-live")).to_have_attribute("data-state", "live")
        await release(state, run_id, "model")

        # Tokens as the model puts them, before any model record.
        preview = page.locator("#live li.k-stream")
        half = "".join(words(REPLY)[: len(words(REPLY)) // 2])
        await expect(preview.locator("pre.tokens")).to_have_text(half, timeout=WAIT)
        await expect(preview).to_have_attribute("data-state", "streaming")
        await expect(timeline.locator("li.k-model")).to_have_count(0)
        await shot(page, tmp_path, "journal-streaming")
        await release(state, run_id, "tokens")

        # The committed record replaces the preview; the first delivery's
        # claim is stored with it (the riding claim), and shown first.
        model = timeline.locator("li.k-model")
        await expect(model).to_have_count(1, timeout=WAIT)
        await expect(claims).to_have_count(1)
        await expect(timeline.locator("li.rec").first).to_have_class(re.compile(r"\bk-claim\b"))
        await expect(model).to_contain_text(REPLY)
        await expect(model).to_have_class("rec k-model from-stream")
        await expect(page.locator("#live li")).to_have_count(0)

        # The unsafe tool: its intent, its partial output; then its holder is killed.
        intent = timeline.locator("li.k-tool_intent")
        await expect(intent).to_contain_text("send", timeout=WAIT)
        await expect(intent.locator('[data-badge="unsafe"]')).to_be_visible()
        await expect(intent.locator(".tool-state")).to_have_text("running")
        await expect(timeline.locator("li.k-tool_output")).to_contain_text(PARTIAL, timeout=WAIT)
        await wait_for((state / f"{run_id}.tool").exists, timeout=WAIT / 1000)
        holder.kill()
        holder.wait()
        successor = spawn_agent(dev, JOURNAL_TASK, state)

        # The successor's claim fences the killed holder's; its replay answers the
        # intent interrupted, with the partial output, and does not send again.
        await expect(claims).to_have_count(2, timeout=WAIT)
        first_writer = await claims.nth(0).get_attribute("data-writer")
        fence = claims.nth(1).locator(".fence")
        await expect(fence).to_have_attribute("data-fenced-writer", first_writer or "")
        await expect(claims.nth(0).locator(".fenced-by")).to_be_visible()
        result = timeline.locator("li.k-tool_result")
        await expect(result.locator('[data-badge="interrupted"]').first).to_be_visible(timeout=WAIT)
        await expect(result.locator(".partial-output")).to_have_text(PARTIAL)
        await expect(intent.locator(".tool-state")).to_contain_text("interrupted")

        # A model call that fails halfway: its preview stays, marked abandoned.
        abandoned = timeline.locator("li.k-stream.abandoned")
        await expect(abandoned).to_have_count(1, timeout=WAIT)
        await expect(abandoned.locator("pre.tokens")).to_have_text("".join(words(FAILING)))
        await expect(abandoned.locator('[data-badge="abandoned"]')).to_be_visible()

        commit = timeline.locator("li.k-commit")
        await expect(commit).to_contain_text("complete", timeout=WAIT)
        await expect(page.locator("#step-end")).to_contain_text("completed", timeout=WAIT)
        await expect(page.locator("#step-status")).to_have_text("completed")
        await shot(page, tmp_path, "journal-finished")

        await page.goto(f"/ui/#/runs/{run_id}")
        await expect(page.locator("#run-status")).to_have_text("completed")
        check = page.locator("#check-result")
        await expect(check).to_have_attribute("data-sound", "true", timeout=WAIT)
        await expect(check).to_contain_text("no violations")
        await shot(page, tmp_path, "run-checked")
    finally:
        reap(holder, successor)
    effects = (await http.get(f"/runs/{run_id}")).json()
    assert effects["output"] == {"interrupted": True, "partial": PARTIAL}


async def test_a_runs_usage_and_budget_show_on_its_page(
    page: Page, http: httpx.AsyncClient, agent: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    body = {"workflow": WORKFLOW, "input": {"script": "usage"}, "budget": {"tokens": 200}}
    response = await http.post("/runs", json=body)
    assert response.status_code == 201, response.text
    run_id = response.json()["run_id"]
    await page.goto(f"/ui/#/runs/{run_id}")
    await expect(page.locator("#run-status")).to_have_text("failed", timeout=WAIT)
    await expect(page.locator("#run-budget")).to_have_text("200 tokens; fails when spent")
    run = page.locator('#usage tr[data-usage="run"]')
    await expect(run.locator(".calls")).to_have_text("2", timeout=WAIT)  # the third refused
    await expect(run.locator(".input")).to_have_text("200")
    await expect(run.locator(".output")).to_have_text("40")
    await expect(run.locator(".kept")).to_have_text("2")
    await expect(page.locator('#usage tr[data-usage="agent"] .calls')).to_have_text("2")
    await shot(page, tmp_path, "run-usage")


async def test_a_parallel_group_shows_as_one_entry_its_calls_each_with_their_fate(
    page: Page, http: httpx.AsyncClient, dev: DevProcess, state: Path, tmp_path: Path
) -> None:
    agent = spawn_agent(dev, JOURNAL_TASK, state)
    try:
        await ready(agent, state)
        run_id = await start(http, JOURNAL_WORKFLOW, "group")
        await page.goto(f"/ui/#/runs/{run_id}/steps/agent")
        timeline = page.locator("#timeline")
        group = timeline.locator("li.k-tool_intents")
        await expect(group).to_have_count(1, timeout=WAIT)
        await expect(timeline.locator("li.k-tool_intent")).to_have_count(0)
        calls = group.locator("li.group-call")
        await expect(calls).to_have_count(3)
        await expect(calls.locator(".tool-name")).to_have_text(["search", "send", "search"])
        await expect(calls.nth(1).locator('[data-badge="unsafe"]')).to_be_visible()
        # The searches return while the send runs, its output so far shown.
        await expect(calls.nth(0).locator(".tool-state")).to_contain_text("returned", timeout=WAIT)
        await expect(calls.nth(2).locator(".tool-state")).to_contain_text("returned", timeout=WAIT)
        await expect(calls.nth(1).locator(".tool-state")).to_have_text("running")
        await expect(calls.nth(1).locator(".partial")).to_have_text(PARTIAL, timeout=WAIT)
        await shot(page, tmp_path, "group-running")
        await release(state, run_id, "send")
        await expect(calls.nth(1).locator(".tool-state")).to_contain_text("returned", timeout=WAIT)
        await expect(page.locator("#step-status")).to_have_text("completed", timeout=WAIT)
        await shot(page, tmp_path, "group-finished")
    finally:
        reap(agent)
    done = (await http.get(f"/runs/{run_id}")).json()
    assert done["output"] == [{"found": "a"}, {"sent": True}, {"found": "b"}]


# ---- 3. inputs ----------------------------------------------------------------------


async def test_a_steer_input_goes_queued_placed_done_and_a_withdrawn_one_shows_withdrawn(
    page: Page, http: httpx.AsyncClient, agent: subprocess.Popen[bytes], state: Path, tmp_path: Path
) -> None:
    run_id = await start(http, WORKFLOW, "inputs")
    await page.goto(f"/ui/#/runs/{run_id}/steps/agent")
    await expect(page.locator("#tokens-live")).to_have_attribute("data-state", "live")
    await wait_for((state / f"{run_id}.queued").exists, timeout=WAIT / 1000)

    await page.fill("#input-content", "turn left")
    await page.click("#input-submit")
    first = page.locator("#inputs-list li").filter(has_text="turn left")
    await expect(first.locator(".status")).to_have_text("queued")

    await release(state, run_id, "queued")
    await expect(first.locator(".status")).to_have_text("placed", timeout=WAIT)
    await expect(page.locator("#timeline li.k-input_placed")).to_contain_text("Steer input")

    await wait_for((state / f"{run_id}.placed").exists, timeout=WAIT / 1000)
    await page.fill("#input-content", "turn right")
    await page.click("#input-submit")
    second = page.locator("#inputs-list li").filter(has_text="turn right")
    await expect(second.locator(".status")).to_have_text("queued")
    await second.locator("button.withdraw").click()
    await expect(second.locator(".status")).to_have_text("withdrawn", timeout=WAIT)
    await expect(second.locator(".history")).to_have_text("queued → withdrawn")

    await release(state, run_id, "placed")
    await expect(first.locator(".status")).to_have_text("done", timeout=WAIT)
    await expect(first.locator(".history")).to_have_text("queued → placed → done")
    await expect(page.locator("#step-end")).to_contain_text("completed", timeout=WAIT)
    await shot(page, tmp_path, "inputs")
    done = (await http.get(f"/runs/{run_id}")).json()
    assert done["output"] == {"placed": ["turn left"]}


# ---- 3c. a fork and a diff -------------------------------------------------------


async def test_a_run_is_forked_from_a_record_of_its_timeline_and_diffed_with_its_source(
    page: Page, http: httpx.AsyncClient, agent: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    source = await start(http, WORKFLOW, "wait")
    await wait_for_status(http, source, "waiting")
    submitted = await http.post(
        f"/runs/{source}/steps/agent/inputs",
        json={"request_id": "go", "mode": "steer", "content": "go on"},
    )
    assert submitted.status_code == 201, submitted.text
    await wait_for_status(http, source, "completed", run=True)
    await page.goto(f"/ui/#/runs/{source}/steps/agent")
    await expect(page.locator("#step-end")).to_contain_text("completed", timeout=WAIT)
    # The continue that ended iteration 0 (it waited for an input).
    commit = page.locator("#timeline li.k-commit").first
    await commit.locator("button.fork-here").click()
    form = commit.locator("form.fork-form")
    await form.locator("textarea.fork-settings").fill("model=b")
    await form.locator("input.fork-steer").fill("turn back")
    await shot(page, tmp_path, "fork-form")
    await form.locator("button.fork-submit").click()
    await expect(page).to_have_url(re.compile(r"/ui/#/runs/[0-9a-f]{32}$"), timeout=WAIT)
    forked = page.url.rsplit("/", 1)[1]
    assert forked != source
    await expect(page.locator("#run-status")).to_have_text("completed", timeout=WAIT)
    await expect(page.locator("#forked-from")).to_contain_text(source[:12])
    await expect(page.locator("#run-settings")).to_have_text("model=b")
    sound = page.locator("#check-result")
    await expect(sound).to_have_attribute("data-sound", "true", timeout=WAIT)
    await page.click("#diff-source")
    diff = page.locator('#diff .diff-step[data-step="agent"]')
    await expect(diff.locator(".diff-common")).to_have_text("1 entry in common", timeout=WAIT)
    await expect(diff.locator("tbody tr").first).to_contain_text("turn back")
    await expect(diff.locator("tbody tr").first).to_contain_text("go on")
    await expect(page.locator("#outcome-a")).to_contain_text("turn back")
    await expect(page.locator("#outcome-b")).to_contain_text("go on")
    await shot(page, tmp_path, "diff")
    # Any two runs, from a run's page.
    await page.goto(f"/ui/#/runs/{source}")
    await page.fill("#diff-other", forked)
    await page.click("#diff-go")
    await expect(page).to_have_url(re.compile(rf"/ui/#/runs/{source}/diff/{forked}$"))
    await expect(page.locator("#outcome-a")).to_contain_text("go on", timeout=WAIT)
    done = (await http.get(f"/runs/{forked}")).json()
    assert done["output"] == {"placed": ["turn back"]}
    assert done["forked_from"]["run_id"] == source


async def wait_for_status(
    http: httpx.AsyncClient, run_id: str, status: str, *, run: bool = False
) -> None:
    """Wait until the run (``run``) or its step ``agent`` has ``status``."""

    async def reached() -> bool:
        found = (await http.get(f"/runs/{run_id}")).json()
        return bool((found["status"] if run else found["steps"][0]["status"]) == status)

    await wait_for(reached, timeout=WAIT / 1000, message=f"run {run_id} {status}")


# ---- 3b. approvals -----------------------------------------------------------------


async def test_a_call_waiting_for_approval_shows_its_arguments_and_is_approved_from_the_page(
    page: Page, http: httpx.AsyncClient, dev: DevProcess, tmp_path: Path
) -> None:
    name, task = "console-approvals", "console-approvals-task"
    assert (await http.post("/workflows", json=loop(name, task))).status_code == 200
    worker = approval_worker(dev.engine, task, tmp_path / "worker")
    try:
        await wait_for((tmp_path / "worker" / "ready").exists, timeout=30)
        response = await http.post("/runs", json={"workflow": name, "input": "send it"})
        run_id = response.json()["run_id"]
        await page.goto(f"/ui/#/runs/{run_id}/steps/agent")
        card = page.locator("#approvals-list li.approval")
        await expect(card).to_have_count(1, timeout=WAIT)
        await expect(card.locator(".tool")).to_have_text("send_email")
        await expect(card).to_contain_text("bob@example.com")
        listed = (await http.get(f"/runs/{run_id}/steps/agent/approvals")).json()["approvals"]
        await expect(card.locator(".digest")).to_have_text(listed[0]["digest"])
        asked = page.locator("#timeline li.k-tool_result").last
        await expect(asked).to_contain_text("waits for approval; it did not run")
        await shot(page, tmp_path, "approval-waiting")
        await card.locator("button.approve").click()
        await expect(page.locator("#approval-msg")).to_contain_text("Approved send_email")
        await expect(page.locator("#approvals-none")).to_be_visible(timeout=WAIT)
        await expect(page.locator("#step-end")).to_contain_text("completed", timeout=WAIT)
        given = page.locator("#timeline .approval-given")
        await expect(given).to_contain_text("approved by console")
        await shot(page, tmp_path, "approval-approved")
    finally:
        reap(worker)
    assert len(lines(tmp_path / "worker", "runs")) == 1
    approvals = (await http.get(f"/runs/{run_id}/steps/agent/approvals")).json()["approvals"]
    assert approvals == []


# ---- 4. cancel, and the token ------------------------------------------------------


async def test_a_run_is_cancelled_from_its_page_and_without_a_token_the_page_asks_for_one(
    browser: Browser,
    dev: DevProcess,
    http: httpx.AsyncClient,
    agent: subprocess.Popen[bytes],
    tmp_path: Path,
) -> None:
    run_id = await start(http, PARENT_WORKFLOW, "wait")
    phone: Any = {"width": 390, "height": 844}  # playwright's ViewportSize
    context = await browser.new_context(base_url=dev.gateway, viewport=phone)
    tab = await context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda err: errors.append(str(err)))
    try:
        await tab.goto(f"/ui/#/runs/{run_id}")
        prompt = tab.locator("#auth")
        await expect(prompt).to_be_visible()
        await expect(tab.locator("#auth-message")).to_have_attribute("data-reason", "missing")
        await expect(tab.locator("#auth-message")).to_contain_text("needs its API token")
        refused = await tab.evaluate(
            "fetch('/runs/' + location.hash.split('/')[2]).then(r => r.status)"
        )
        assert refused == 401, "the API must refuse a request without the token"
        await shot(tab, tmp_path, "token-prompt")

        await tab.fill("#token-input", "not-the-token")
        await tab.click("#token-form button")
        await expect(tab.locator("#auth-message")).to_have_attribute("data-reason", "refused")
        await expect(tab.locator("#auth-message")).to_contain_text("refused the token")
        assert await tab.evaluate("sessionStorage.length") == 0, "a refused token is not kept"

        await tab.fill("#token-input", TOKEN)
        await tab.click("#token-form button")
        await expect(prompt).to_be_hidden()
        await expect(tab.locator("#run-status")).to_have_text("running")
        child = tab.locator('#steps-body tr[data-step-id="child"] .child a')
        await expect(child).to_be_visible(timeout=WAIT)
        child_href = await child.get_attribute("href")
        await child.click()
        await expect(tab.locator('#steps-body tr[data-step-id="agent"] .wait')).to_contain_text(
            "until an input", timeout=WAIT
        )
        await tab.go_back()

        await tab.click("#cancel-run")
        await tab.click("#cancel-confirm")
        await expect(tab.locator("#run-status")).to_have_text("cancelled", timeout=WAIT)
        await expect(tab.locator('#steps-body tr[data-step-id="child"] .status')).to_have_text(
            "cancelled"
        )
        await expect(tab.locator("#run-error")).to_contain_text("cancelled from the console")
        await expect(tab.locator("#check-result")).to_have_attribute("data-sound", "true")
        await expect(tab.locator("#cancel-run")).to_be_hidden()
        wider = await tab.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert wider <= 0, f"the run page is {wider}px wider than a phone's screen"
        await shot(tab, tmp_path, "run-cancelled-phone")

        await tab.goto(f"/ui/{child_href}")
        await expect(tab.locator("#run-status")).to_have_text("cancelled", timeout=WAIT)

        # What a waiting step waits for: a delay, or a time (and, above, an input).
        for script, says in [("delay", "delay 600s"), ("until", "until ")]:
            waiting = await start(http, WORKFLOW, script)
            await tab.goto(f"/ui/#/runs/{waiting}")
            wait = tab.locator('#steps-body tr[data-step-id="agent"] .wait')
            await expect(wait).to_contain_text(says, timeout=WAIT)
            await expect(wait.locator("time")).to_be_visible()
            await http.post(f"/runs/{waiting}/cancel", json={})
    finally:
        await context.close()
    assert errors == [], errors
    async with httpx.AsyncClient(base_url=dev.gateway) as anonymous:
        assert (await anonymous.get(f"/runs/{run_id}")).status_code == 401


# ---- a run waiting for its build ----------------------------------------------------


async def test_a_run_waiting_for_its_build_shows_it_and_moves_to_another_build(
    page: Page, http: httpx.AsyncClient, dev: DevProcess, tmp_path: Path
) -> None:
    name, task = "console-builds", "console-builds-task"
    assert (await http.post("/workflows", json=loop(name, task))).status_code == 200
    a, b = Build("A"), Build("B")
    async with Worker(dev.engine, handlers={task: a.handler}, build_id="A", poll_wait=1.0):
        run_id = await start(http, name, "")

        async def waits_for_input() -> bool:
            step = (await http.get(f"/runs/{run_id}")).json()["steps"][0]
            return bool(step.get("waiting_for_input"))

        await wait_for(waits_for_input, timeout=30)
    go = {"request_id": "go", "content": "go"}
    assert (await http.post(f"/runs/{run_id}/steps/agent/inputs", json=go)).status_code == 201
    await page.goto(f"/ui/#/runs/{run_id}")
    row = page.locator('tr[data-step-id="agent"]')
    await expect(row.locator('[data-wait="build"]')).to_have_text(
        "waiting for build A", timeout=WAIT
    )
    await shot(page, tmp_path, "waiting-for-build")
    async with Worker(dev.engine, handlers={task: b.handler}, build_id="B", poll_wait=1.0):
        bad = await http.post(f"/runs/{run_id}/upgrade", json={"build_id": "v1.2"})
        assert bad.status_code == 400 and "build_id" in bad.text
        moved = await http.post(f"/runs/{run_id}/upgrade", json={"build_id": "B"})
        assert moved.status_code == 200 and moved.json()["steps"][0]["build_id"] == "B"
        await expect(row).to_have_attribute("data-status", "completed", timeout=WAIT)
    await expect(row).to_have_attribute("data-build", "B")
    assert b.iterations_of(run_id) == [1]
    gone = await http.post(f"/runs/{run_id}/upgrade", json={"build_id": "C"})
    assert gone.status_code == 409


# ---- the files ----------------------------------------------------------------------


async def test_the_console_is_served_without_a_token_and_the_api_behind_it_needs_one(
    dev: DevProcess,
) -> None:
    async with httpx.AsyncClient(base_url=dev.gateway) as anonymous:
        root = await anonymous.get("/ui")
        assert (root.status_code, root.headers["location"]) == (308, "/ui/")
        page = await anonymous.get("/ui/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert '<script type="module" src="app.js">' in page.text
        policy = page.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "default-src 'none'" in policy
        assert page.headers["x-content-type-options"] == "nosniff"
        for name, kind in [("app.js", "text/javascript"), ("console.css", "text/css")]:
            found = await anonymous.get(f"/ui/{name}")
            assert found.status_code == 200 and kind in found.headers["content-type"]
        for missing in ("/ui/nope.js", "/ui/..%2Fconsole.py", "/ui/%2E%2E/rest.py"):
            response = await anonymous.get(missing)
            assert response.status_code == 404, missing
        for path in ("/runs", "/runs/events", "/workflows"):
            assert (await anonymous.get(path)).status_code == 401, path
    async with httpx.AsyncClient(base_url=dev.gateway, headers=_bearer()) as http:
        document = (await http.get("/openapi.json")).json()
    listed = document["paths"]["/runs/events"]["get"]
    assert "text/event-stream" in listed["responses"]["200"]["content"]
    assert {p["name"] for p in listed["parameters"]} == {"workflow", "status", "limit"}
    assert not any(p.startswith("/ui") for p in document["paths"])
