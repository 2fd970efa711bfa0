"""The documentation site: it builds with no broken link, its generated
reference matches the code, and every example the tutorial and the how-to
guides show runs.

The examples live in docs/examples/ and the pages include them, so what runs
here is what a reader copies; a page of the tutorial or the how-to guides
with a Python block of its own fails a test. They run against one LocalStack (with the
gateway) shared by the module, as `make dev` would serve them; the crash
example runs as processes of its own, as a reader runs it.
"""

from __future__ import annotations

import asyncio
import html
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import pytest_asyncio

from dagnats.cli.main import build_parser
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.sdk import JournalClient, run_output
from dagnats.sdk.testing import LocalStack
from tests.stack import FAST

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"


def load(name: str) -> ModuleType:
    """A docs example as a module (the folder is no package: each file runs alone)."""
    spec = importlib.util.spec_from_file_location(f"docs_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: a dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack() -> AsyncIterator[LocalStack]:
    # A task whose worker died comes back after FAST's 2 s lease, not 30 s.
    async with LocalStack(gateway=True, engine_config=FAST) as s:
        yield s


@dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str


async def example(args: list[str], stack: LocalStack, cwd: Path, **env: str) -> Ran:
    """Run a docs example as a reader does, against the stack's engine (the
    stack serves on this event loop meanwhile)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        cwd=cwd,
        env={**os.environ, "DAGNATS_ENGINE": stack.target, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=90)
    assert process.returncode is not None
    return Ran(process.returncode, out.decode(), err.decode())


# The site.

SNIPPET = re.compile(r'^--8<-- "([\w.]+):(\w+)"$', re.M)


def included_sections() -> list[tuple[str, str, str]]:
    """Every example section a page includes: (page, file, section)."""
    docs = ROOT / "docs"
    return [
        (str(page.relative_to(docs)), source, section)
        for page in sorted(docs.rglob("*.md"))
        for source, section in SNIPPET.findall(page.read_text())
    ]


def section_lines(source: str, section: str) -> list[str]:
    """The non-blank lines of a named section of a docs example."""
    text = (EXAMPLES / source).read_text()
    start, end = f"# --8<-- [start:{section}]", f"# --8<-- [end:{section}]"
    if start not in text or end not in text:
        return []
    body = text.split(start, 1)[1].split(end, 1)[0]
    return [line for line in body.splitlines() if line.strip()]


# A fenced Python block, possibly indented under a list item.
PYTHON_BLOCK = re.compile(r"^[ \t]*```[ \t]*(?:python|py)\b[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)


def examples_this_module_runs() -> set[str]:
    """The docs examples a test of this module loads or runs as a process."""
    source = Path(__file__).read_text()
    loaded = re.findall(r'\bload\("(\w+)"\)', source)
    started = re.findall(r'EXAMPLES / "(\w+)\.py"', source)
    return {f"{name}.py" for name in [*loaded, *started]}


def test_every_python_block_of_the_tutorial_and_how_tos_is_an_example_a_test_runs() -> None:
    """A reader copies the tutorial's and the how-to guides' Python: each block
    is only includes of sections of docs/examples/ files that this module
    runs, so an example that stops working fails here, not in a reader's hands."""
    docs, ran = ROOT / "docs", examples_this_module_runs()
    pages = sorted([*(docs / "tutorial").glob("*.md"), *(docs / "how-to").glob("*.md")])
    problems, blocks = [], 0
    for page in pages:
        for block in PYTHON_BLOCK.findall(page.read_text()):
            blocks += 1
            for line in block.strip().splitlines():
                found = SNIPPET.fullmatch(line.strip())
                if found is None:
                    problems.append(f"{page.name}: inline code, not an example: {line.strip()!r}")
                    break
                source, section = found.groups()
                if not section_lines(source, section):
                    problems.append(f"{page.name}: {source}:{section} is empty or missing")
                elif source not in ran:
                    problems.append(f"{page.name}: no test of this module runs {source}")
    assert blocks > 20, "the blocks were not found: has the fence syntax changed?"
    assert problems == []


def test_every_tutorial_page_includes_its_examples() -> None:
    pages = {page for page, _, _ in included_sections()}
    assert {
        f"tutorial/{p}.md" for p in ("first-agent", "pydantic-ai", "steering", "streaming")
    } <= pages
    for page in sorted((ROOT / "docs" / "tutorial").glob("*.md")):
        assert "--8 <" not in page.read_text(), f"{page.name}: a snippet line was reformatted"


def test_the_site_builds_strict_with_no_broken_link(tmp_path: Path) -> None:
    """`mkdocs build --strict` (what `make docs` and CI run) fails on a broken
    internal link or anchor, a missing included example, a docstring
    mkdocstrings cannot read, or a reference generator that fails."""
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    for page in ("tutorial/first-agent", "reference/settings", "reference/cli", "reference/grpc"):
        assert (tmp_path / page / "index.html").is_file(), page
    for page, source, section in included_sections():
        lines = section_lines(source, section)
        assert lines, f"{page}: {source}:{section} is empty or missing"
        built_page = tmp_path / page.removesuffix(".md") / "index.html"
        text = html.unescape(re.sub(r"<[^>]+>", "", built_page.read_text()))
        assert "--8<--" not in text and "--8 <" not in text, (
            f"{page}: a snippet line was not included"
        )
        assert lines[0].strip() in text, f"{page} does not show {source}:{section}"
    settings = (tmp_path / "reference" / "settings" / "index.html").read_text()
    assert "DAGNATS_TASK_ACK_WAIT" in settings
    grpc_page = (tmp_path / "reference" / "grpc" / "index.html").read_text()
    assert "JournalService" in grpc_page and "BeginTool" in grpc_page
    http_page = (tmp_path / "reference" / "http" / "index.html").read_text()
    assert "/runs/{run_id}/cancel" in http_page or "/runs/{id}/cancel" in http_page


def test_every_setting_the_code_reads_is_in_the_catalogue() -> None:
    spec = importlib.util.spec_from_file_location(
        "docs_gen", ROOT / "docs" / "gen" / "reference.py"
    )
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.settings_drift() == []
    assert "DAGNATS_TASK_ACK_WAIT" in gen.variables_in_code()


def test_the_readmes_agent_is_the_first_tutorials_handler() -> None:
    """The README shows the handler the tutorial includes and this module runs,
    line for line, so the landing page's agent cannot drift from one that works."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", readme, re.M | re.S)
    assert blocks, "the README shows no Python code"
    handler = (EXAMPLES / "first_agent.py").read_text()
    body = handler.split("# --8<-- [start:handler]\n", 1)[1].split("# --8<-- [end:handler]", 1)[0]
    assert blocks[0].strip() == body.strip()


def test_every_link_of_the_readme_names_a_file_of_the_tree() -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme)
    assert "docs/tutorial/index.md" in links
    assert [link for link in links if not (ROOT / link).is_file()] == []


# Tutorial 1: your first durable agent.


async def test_first_agent_answers(stack: LocalStack, tmp_path: Path) -> None:
    done = await example([str(EXAMPLES / "first_agent.py")], stack, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "answer: It is 21 C in Lisbon; ops has been told." in done.stdout
    assert len((tmp_path / "outbox.txt").read_text().splitlines()) == 1


async def test_first_agent_recovers_from_the_crash_you_cause(
    stack: LocalStack, tmp_path: Path
) -> None:
    crashed = await example([str(EXAMPLES / "first_agent.py"), "--crash"], stack, tmp_path)
    assert crashed.returncode == 3, crashed.stderr
    assert "crashing inside send_email" in crashed.stdout
    run_id = next(
        line.split()[1] for line in crashed.stdout.splitlines() if line.startswith("run ")
    )

    resumed = await example([str(EXAMPLES / "first_agent.py"), "--resume", run_id], stack, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    # The model's turn-2 reply was stored before the tool started: the new
    # worker does not ask for it again, and the email is not sent twice.
    assert "asking the model (turn 2)" not in resumed.stdout
    assert "asking the model (turn 3)" in resumed.stdout
    assert "answer: It is 21 C in Lisbon; ops has been told." in resumed.stdout
    assert len((tmp_path / "outbox.txt").read_text().splitlines()) == 1


# Tutorial 2: a pydantic-ai agent.


async def test_pydantic_agent_answers_with_the_stand_in_model(
    stack: LocalStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DAGNATS_MODEL", raising=False)
    agent = load("pydantic_agent")
    answer = await agent.main(stack.target)
    assert answer == "It is 21 C and clear in Lisbon; ops has been told."
    assert len(agent.SENT) == 1 and agent.SENT[0].count(".") == 3  # one email, with its key


async def test_the_tutorials_agent_test_passes() -> None:
    await load("pydantic_test").test_the_agent_answers()


# Tutorial 3: steering, follow-ups and waiting for a person.


async def test_steering_example_waits_for_the_person_and_takes_every_input(
    stack: LocalStack,
) -> None:
    answer = await load("steering").main(stack.target)
    assert answer == "Lisbon weather for ops / in celsius / add the sky"


# How-to: a conversation of any length.


async def test_long_conversation_example_stores_what_each_turn_adds(stack: LocalStack) -> None:
    found = await load("long_conversation").main(stack.target)
    assert found["turns"] == 300 and found["violations"] == 0
    assert found["state"] > 6_000_000
    # Each commit stored its turn's 20 KB (and a few snapshots while the state
    # fit a record), not the history again: far below 300 whole states.
    assert found["stored"] < 2 * found["state"], found


# Tutorial 4: streaming tokens to a page.


async def test_streaming_example_reads_the_tokens_then_the_stored_response(
    stack: LocalStack,
) -> None:
    tokens, response, output = await load("streaming").main(stack.target, stack.gateway_url)
    assert response == output == "It is 21 C and clear in Lisbon."
    # A preview is not a record: the reader may join after some tokens, but
    # what it saw is the tail of the response, in order.
    seen = "".join(tokens).strip()
    assert response.endswith(seen)


# Where the site is named.


# How-to: a response's tool calls at once.


async def test_parallel_tools_example_answers_from_one_group_of_calls(
    stack: LocalStack,
) -> None:
    answer, run_id = await load("parallel_tools").main(stack.target)
    assert answer == "Lisbon 21 °C, Porto 20 °C, Faro 24 °C"
    async with JournalClient(stack.target) as journal:
        records = [r async for r in journal.read(run_id, "agent")]
        assert not (await journal.check(run_id)).violations
    (group,) = [r for r in records if r.HasField("tool_intents")]
    assert [i.name for i in group.tool_intents.intents] == ["weather"] * 3 + ["notify"]


# How-to: fork and diff a run.


async def test_fork_and_diff_example_asks_only_the_other_model_after_the_fork(
    stack: LocalStack,
) -> None:
    first, second, calls = await load("fork_and_diff").main(stack.target)
    assert first == '"small says: 3 results for durable agents"'
    assert second == '"large says: 3 results for durable agents"'
    assert calls == ["small", "small", "large"]  # the fork asked nothing before its record


# How-to: usage and budgets.


async def test_usage_budget_example_pauses_then_goes_on_once_raised(stack: LocalStack) -> None:
    status, usage = await load("usage_budget").main(stack.target)
    assert status == pb.RUN_STATUS_COMPLETED
    spent = usage.total.spent
    # 1,200 tokens a call: two under 2,000, the third refused; raised to 5,000, one more.
    assert (spent.calls, spent.input_tokens, spent.output_tokens) == (3, 3000, 600)
    assert usage.total.kept == spent


def test_the_cli_and_the_console_name_the_address_docs_serve_serves() -> None:
    served = re.search(r"^DOCS_ADDR := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert served is not None
    url = f"http://{served.group(1)}/"
    assert url in build_parser().format_help()
    console = ROOT / "services" / "gateway" / "dagnats" / "gateway" / "ui" / "index.html"
    assert f'href="{url}"' in console.read_text()


# How-to: approve a tool call.


async def test_approvals_example_runs_the_tool_once_the_digest_is_approved(
    stack: LocalStack,
) -> None:
    approvals = load("approvals")
    output = await approvals.main(stack.target, stack.gateway_url)
    assert output == {"paid": 1200, "key": output["key"]}
    assert approvals.PAID == [{"to": "acme", "cents": 1200}]


async def test_approvals_group_example_runs_the_others_then_the_approved_call_once(
    stack: LocalStack,
) -> None:
    example = load("approvals_group")
    output = await example.main(stack.target, stack.gateway_url)
    assert output == [
        {"email": "bob@example.com"},
        {"attached": "invoice.pdf"},
        {"sent": "bob"},
    ]
    assert sorted(example.RAN[:2]) == ["attach", "lookup"]  # they ran while it waited
    assert example.RAN[2:] == ["send_email"]


async def test_approvals_pydantic_example_sends_the_email_once_approved(
    stack: LocalStack,
) -> None:
    example = load("approvals_pydantic")
    done = await example.main(stack.target, stack.gateway_url)
    assert run_output(done) == "ops has been told."
    assert example.SENT == [{"to": "ops@example.com", "body": "Lisbon: 21 C"}]


# How-to: write workers and workflows.


async def test_checkpoint_agent_example_keeps_its_history_in_the_checkpoint(
    stack: LocalStack,
) -> None:
    assert await load("checkpoint_agent").main(stack.target) == "It is 21 C in Lisbon."


async def test_many_waiting_example_lists_the_newest_runs_and_the_cancelled_one(
    stack: LocalStack,
) -> None:
    found = await load("many_waiting").main(stack.target, tickets=8)
    started = found["started"]
    assert [r.run_id for r in found["newest"]] == started[::-1][:5]
    assert [r.run_id for r in found["cancelled"]] == [started[0]]


async def test_run_and_wait_example_gets_the_output_the_changes_and_the_failure(
    stack: LocalStack,
) -> None:
    found = await load("run_and_wait").main(stack.target)
    assert found["answer"] == {"answer": "you said 'hi'"}
    assert run_output(found["done"]) == {"answer": "you said 'again?'"}
    assert found["failed"].status == "failed" and "asked to fail" in found["failed"].error


async def test_models_example_asks_the_stand_in_and_runs_its_tool(
    stack: LocalStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DAGNATS_MODEL", raising=False)
    assert await load("models_agent").main(stack.target) == "It is 21 C in Lisbon."


# How-to: replay recorded runs against new code.


async def test_replay_example_passes_the_same_code_and_catches_the_reordered_calls(
    stack: LocalStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ci = load("replay_in_ci")
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    same, changed = await ci.main(stack.target, recorded)
    assert same.ok and same.dispatches == 3, same.lines()
    first = changed.divergences[0]
    assert (first.position, first.kind, first.recorded) == (0, "different_call", "a model call")
    assert first.asked.startswith("tool 'weather'")
    # The page's CI test, run where it looks for recorded/: it fails, naming the change.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AssertionError, match="position 0: different_call"):
        await ci.test_the_new_code_replays_the_recorded_runs()


# How-to: new handler code under runs in flight.


async def test_builds_example_keeps_a_run_on_its_build_and_moves_one_whose_build_left(
    stack: LocalStack,
) -> None:
    sent = await load("builds").main(stack.target)
    assert sent == {"first": "2026-12-01", "second": "2026-12-06"}
