"""The usage ledger and budgets through a real worker, the services and a
nats-server: usage totals equal what the local provider servers reported
(OpenAI's and Anthropic's wire formats), priced by the journal's price table;
a handler's own usage; totals in ``GetRun``, REST and ``run get``; a budget
that refuses the call that would start past it, under the fail policy and
under the pause policy (an input raises it and the run goes on); and a
fenced holder's call counted as fenced and charged once to the budget."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from dagnats.core import seam
from dagnats.engine.metrics import serve_metrics
from dagnats.engine.server import EngineServer, start_engine
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.integrations.pydantic_ai import durable_agent
from dagnats.sdk import (
    Budget,
    BudgetExceeded,
    Client,
    InputMode,
    TaskContext,
    Usage,
    WithUsage,
    Worker,
)
from dagnats.sdk.models import UserMessage, ask
from tests.helpers import wait_for
from tests.providers import MODEL, FakeProvider, Reply
from tests.stack import FAST, loop_workflow, socket_dir, unique
from tests.test_bridge import call, poll
from tests.test_bridge import start as bridge_start
from tests.test_cli import adagnats
from tests.test_journal import NO_HEARTBEAT, journal_check, read_journal
from tests.test_models import adapter
from tests.test_pydantic_ai import QUESTION, Tools, openai_client, script, weather_agent

CALL = Usage(input_tokens=10, output_tokens=5, model=MODEL)  # 15 tokens a call
# Per million tokens; the fake servers answer as MODEL.
PRICES = {MODEL: {"input": 2.0, "output": 10.0, "cached": 0.5}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(nats_server: Any) -> AsyncIterator[EngineServer]:
    """The services with a price table (``DAGNATS_PRICES``)."""
    os.environ["DAGNATS_PRICES"] = json.dumps(PRICES)
    try:
        with socket_dir() as sockets:
            server = await start_engine(
                nats_server.url, config=FAST, local_socket=sockets / "local.sock"
            )
            yield server
            await server.stop()
    finally:
        del os.environ["DAGNATS_PRICES"]


def micros(input_tokens: int, output_tokens: int, cached: int) -> int:
    p = PRICES[MODEL]
    fresh = input_tokens - cached
    return round(fresh * p["input"] + cached * p["cached"] + output_tokens * p["output"])


async def run_loop(
    client: Client,
    engine: EngineServer,
    handler: Any,
    *,
    budget: Budget | None = None,
    until: Any = None,
    **worker: Any,
) -> pb.Run:
    task, name = unique("usage"), unique("usage-wf")
    retry = {"max_attempts": 3, "initial_delay": 0.05, "max_delay": 0.1}
    await client.register_workflow(loop_workflow(name, task, retry=retry))
    async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0, **worker):
        run = await client.start_run(name, budget=budget)
        if until is not None:
            await until(run.run_id)
        return await client.wait_for_run(run.run_id, timeout=40)


# ---- usage from the provider ---------------------------------------------------------


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_usage_totals_equal_what_the_provider_reported(
    provider: str, client: Client, engine: EngineServer, http: httpx.AsyncClient
) -> None:
    replies = [
        Reply("first answer", cached=30),
        Reply("second", tools=[("lookup", {"city": "Lisbon"})]),
        Reply("the end of it", cached=5),
    ]
    async with FakeProvider(replies) as fake:
        model = adapter(provider, fake, api_key="k")

        async def turn(tc: TaskContext) -> None:
            j = await tc.journal()
            response = await ask(j, model, [UserMessage(content=f"turn {tc.iteration}")])
            if tc.iteration < 2:
                await tc.continue_(response.text)
            else:
                await tc.complete(response.text)

        run = await run_loop(client, engine, turn)
        await model.aclose()
    assert run.status == pb.RUN_STATUS_COMPLETED

    reported = [r.usage() for r in replies]
    inputs, outputs, cached = (sum(u[i] for u in reported) for i in range(3))
    cost = sum(micros(*u) for u in reported)
    usage = await client.run_usage(run.run_id)
    kept = usage.total.kept
    assert (kept.calls, kept.input_tokens, kept.output_tokens, kept.cached_tokens) == (
        3,
        inputs,
        outputs,
        cached,
    )
    assert kept.cost_micros == cost
    assert usage.total.spent == kept and usage.total.retried.calls == usage.total.fenced.calls == 0
    [step] = usage.steps
    assert step.step_id == "agent" and step.usage.spent == kept
    assert dict(step.by_model) == {MODEL: kept}

    # The same numbers over REST.
    answer = (await http.get(f"/runs/{run.run_id}/usage")).json()
    assert answer["total"]["kept"] == {
        "calls": 3,
        "input_tokens": inputs,
        "output_tokens": outputs,
        "cached_tokens": cached,
        "cost": cost / 1e6,
    }
    assert answer["steps"][0]["by_model"][MODEL]["calls"] == 3


async def test_a_pydantic_ai_agents_usage_totals_equal_what_the_provider_reported(
    client: Client, engine: EngineServer
) -> None:
    replies = script()
    replies[0].cached = 7
    task, name = unique("usage-pyai"), unique("usage-pyai-wf")
    await client.register_workflow(loop_workflow(name, task))
    async with FakeProvider(replies) as provider, openai_client(provider) as api:
        handler = durable_agent(weather_agent(api, Tools()), follow_up_window=None)
        async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
            run = await client.start_run(name, QUESTION)
            done = await client.wait_for_run(run.run_id, timeout=60)
    assert done.status == pb.RUN_STATUS_COMPLETED
    reported = [r.usage() for r in replies]
    kept = (await client.run_usage(run.run_id)).total.kept
    assert (kept.calls, kept.input_tokens, kept.output_tokens, kept.cached_tokens) == (
        3,
        *(sum(u[i] for u in reported) for i in range(3)),
    )
    assert kept.cost_micros == sum(micros(*u) for u in reported)

    # Prometheus: the usage counters by workflow and model.
    endpoint = serve_metrics(engine, "127.0.0.1", 0)
    try:
        wanted = {
            ("dagnats_model_calls_total", ""): kept.calls,
            ("dagnats_model_tokens_total", "input"): kept.input_tokens,
            ("dagnats_model_tokens_total", "output"): kept.output_tokens,
            ("dagnats_model_tokens_total", "cached"): kept.cached_tokens,
            ("dagnats_model_cost_micros_total", ""): kept.cost_micros,
        }

        async def counted() -> bool:
            return await usage_samples(endpoint.url, name, MODEL) == wanted

        await wait_for(counted, timeout=10)
    finally:
        endpoint.stop()


async def usage_samples(url: str, workflow: str, model: str) -> dict[tuple[str, str], float]:
    def get() -> str:
        with urllib.request.urlopen(url, timeout=30) as answer:
            text: str = answer.read().decode()
            return text

    text = await asyncio.to_thread(get)
    return {
        (sample.name, sample.labels.get("kind", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("workflow") == workflow and sample.labels.get("model") == model
    }


async def test_a_handler_passes_the_usage_of_its_own_call(
    client: Client, engine: EngineServer
) -> None:
    spent = Usage(input_tokens=1200, output_tokens=300, cached_tokens=200, model="my-model")

    async def turn(tc: TaskContext) -> None:
        j = await tc.journal()

        async def call() -> WithUsage:
            return WithUsage({"text": "hi"}, spent)

        answer = await j.model(call)
        await tc.complete(answer)

    run = await run_loop(client, engine, turn)
    assert run.status == pb.RUN_STATUS_COMPLETED and json.loads(run.output) == {"text": "hi"}
    usage = await client.run_usage(run.run_id)
    kept = usage.total.kept
    assert (kept.input_tokens, kept.output_tokens, kept.cached_tokens) == (1200, 300, 200)
    assert kept.cost_micros == 0  # the price table does not name my-model
    assert list(usage.steps[0].by_model) == ["my-model"]


async def test_an_http_worker_records_the_usage_of_its_calls(
    client: Client, engine: EngineServer, http: httpx.AsyncClient
) -> None:
    task, run_id = await bridge_start(client)
    leased = await poll(http, task)
    read = await call(http, "journal/read", token=leased["token"])
    begin = await call(http, "journal/model/begin", token=read["token"])
    spent = {"input_tokens": 500, "output_tokens": 40, "cached_tokens": 100, "model": MODEL}
    token = await call(
        http, "journal/model/record", token=begin["token"], response={"a": 1}, usage=spent
    )
    appended = await call(
        http,
        "journal/append",
        token=token["token"],
        record={"kind": "model", "response": {"b": 2}, "usage": {**spent, "output_tokens": 60}},
    )
    await call(http, "resolve", token=appended["token"], outcome="complete", output="ok")
    bad = await http.post(
        "/bridge/journal/model/record",
        json={"token": begin["token"], "response": {}, "usage": {"input_tokens": -1}},
    )
    assert bad.status_code in (400, 422)
    kept = (await client.run_usage(run_id)).total.kept
    assert (kept.calls, kept.input_tokens, kept.output_tokens, kept.cached_tokens) == (
        2,
        1000,
        100,
        200,
    )
    assert kept.cost_micros == micros(500, 40, 100) + micros(500, 60, 100)

    # With a budget, the bridge asks the journal to check it before each call.
    task, name = unique("usage-bridge"), unique("usage-bridge-wf")
    await client.register_workflow(loop_workflow(name, task))
    run = await client.start_run(name, budget=Budget(tokens=500))
    leased = await poll(http, task)
    read = await call(http, "journal/read", token=leased["token"])
    begin = await call(http, "journal/model/begin", token=read["token"])
    token = await call(
        http, "journal/model/record", token=begin["token"], response={"a": 1}, usage=spent
    )
    refused = await call(http, "journal/model/begin", status=409, token=token["token"])
    assert (
        refused["code"] == "budget_exceeded"
        and "540 tokens of a budget of 500" in (refused["message"])
    )
    await client.cancel_run(run.run_id)


async def test_a_retried_attempts_calls_are_counted_apart(
    client: Client, engine: EngineServer
) -> None:
    calls: list[int] = []

    async def turn(tc: TaskContext) -> None:
        j = await tc.journal()

        async def call() -> WithUsage:
            calls.append(tc.attempt)
            return WithUsage({"attempt": tc.attempt}, CALL)

        await j.model(call)
        if tc.attempt == 1:
            raise RuntimeError("the tool after the model failed")  # retriable
        await tc.complete("second time")

    run = await run_loop(client, engine, turn)
    assert run.status == pb.RUN_STATUS_COMPLETED and calls == [1, 2]
    total = (await client.run_usage(run.run_id)).total
    assert (total.kept.calls, total.retried.calls, total.spent.calls) == (1, 1, 2)
    assert total.retried.input_tokens == CALL.input_tokens


# ---- budgets --------------------------------------------------------------------------


def looping(calls: list[int], *, turns: int) -> Any:
    """A loop whose every iteration makes one model call of ``CALL``'s usage
    and continues, completing after ``turns`` iterations; ``calls`` counts
    the model functions run."""

    async def turn(tc: TaskContext) -> None:
        j = await tc.journal()

        async def call() -> WithUsage:
            calls.append(tc.iteration)
            return WithUsage({"turn": tc.iteration}, CALL)

        await j.model(call)
        if tc.iteration + 1 < turns:
            await tc.continue_(tc.iteration)
        else:
            await tc.complete("done")

    return turn


async def test_the_budget_refuses_the_call_that_would_start_past_it_and_the_run_fails(
    client: Client, engine: EngineServer
) -> None:
    calls: list[int] = []
    # 15 + 15 = 30 tokens after two calls: the third would start past 25.
    run = await run_loop(client, engine, looping(calls, turns=5), budget=Budget(tokens=25))
    assert run.status == pb.RUN_STATUS_FAILED
    assert calls == [0, 1]  # the third call never ran
    step = run.steps[0]
    assert step.iteration == 2 and step.attempt == 1  # refused, not retried
    assert BudgetExceeded.__name__ in step.error and "30 tokens of a budget of 25" in step.error
    usage = await client.run_usage(run.run_id)
    assert usage.total.spent.calls == 2 and usage.total.spent.input_tokens == 20
    got = await adagnats("run", "get", run.run_id, env={"DAGNATS_ENGINE": engine.target})
    assert got.returncode == 0, got.stderr
    assert "usage     2 calls, 20 in (0 cached), 10 out, cost 0.00014" in got.stdout
    assert "calls: 2 kept, 0 retried, 0 fenced" in got.stdout


async def test_the_budget_pauses_the_run_until_an_input_raises_it(
    client: Client, engine: EngineServer
) -> None:
    calls: list[int] = []
    budget = Budget(tokens=25, policy="pause")

    async def raise_it(run_id: str) -> None:
        async def waiting() -> bool:
            step = (await client.get_run(run_id)).steps[0]
            return step.waiting_for_input and step.iteration == 3

        await wait_for(waiting, timeout=30)
        assert calls == [0, 1]  # the refused iteration called nothing
        run = await client.get_run(run_id)
        assert json.loads(run.steps[0].output)["budget_exceeded"]["tokens"] == 30
        env = {"DAGNATS_ENGINE": engine.target}
        args = ("run", "raise-budget", run_id, "--step", "agent", "--tokens", "40")
        raised = await adagnats(*args, "--request-id", "raise-1", env=env)
        assert raised.returncode == 0, raised.stderr
        _, again = await client.submit_input(
            run_id, "agent", "raise-1", {"tokens": 40}, mode=InputMode.BUDGET
        )
        assert not again  # the same input: idempotent, as every input

    run = await run_loop(client, engine, looping(calls, turns=6), budget=budget, until=raise_it)
    # Two calls spent 30 tokens of 25: iteration 2's call was refused and the
    # step waited as iteration 3. Raised to 65, iterations 3 to 5 call (75).
    assert run.status == pb.RUN_STATUS_COMPLETED
    assert calls == [0, 1, 3, 4, 5]
    usage = await client.run_usage(run.run_id)
    spent = usage.total.spent
    assert spent.calls == 5 and spent.input_tokens + spent.output_tokens == 75
    # The raise is placed in the journal once, at the call it let through.
    placed = [r for r in await read_journal(engine, run.run_id) if r.HasField("input_placed")]
    assert [(p.iteration, p.input_placed.request_id) for p in placed] == [(3, "raise-1")]
    assert list((await journal_check(engine, run.run_id)).violations) == []


async def test_a_bad_budget_or_raise_is_refused_at_the_edge(
    client: Client, engine: EngineServer, http: httpx.AsyncClient
) -> None:
    name = unique("usage-wf")
    await client.register_workflow(loop_workflow(name, unique("usage")))
    bad = await http.post("/runs", json={"workflow": name, "budget": {"tokens": -1}})
    assert bad.status_code == 400 and bad.json()["field"] == "budget.tokens"
    bad = await http.post("/runs", json={"workflow": name, "budget": {"policy": "pause"}})
    assert bad.status_code == 400 and bad.json()["field"] == "budget"
    run = (await http.post("/runs", json={"workflow": name, "budget": {"tokens": 5}})).json()
    assert (await client.get_run(run["run_id"])).budget.tokens == 5
    bad = await http.post(
        f"/runs/{run['run_id']}/steps/agent/inputs",
        json={"request_id": "r", "mode": "budget", "content": {"tokens": "lots"}},
    )
    assert bad.status_code == 400 and bad.json()["field"] == "content"
    await client.cancel_run(run["run_id"])

    # A workflow's budget: shown with the workflow, taken by a run without its own.
    budgeted = unique("usage-wf")
    document = loop_workflow(budgeted, unique("usage"))
    document["budget"] = {"cost": 0.25, "policy": "pause"}
    await client.register_workflow(document)
    shown = (await http.get(f"/workflows/{budgeted}")).json()
    assert shown["budget"] == {"tokens": 0, "cost": 0.25, "policy": "pause"}
    started = (await http.post("/runs", json={"workflow": budgeted})).json()
    assert started["budget"] == {"tokens": 0, "cost": 0.25, "policy": "pause"}
    await client.cancel_run(started["run_id"])


# ---- a fenced holder ------------------------------------------------------------------


async def test_a_fenced_call_is_counted_and_charged_once_to_the_budget(
    client: Client, engine: EngineServer
) -> None:
    """The first delivery's handler stops between its model call and its record
    (the seam ``model_pending``) and sends no heartbeat: its lease runs out, a
    second delivery takes the step over and calls the model again. Let go, the
    first one is fenced: its call's usage goes to the step's spent subject.
    The second delivery's next call starts only because the fenced call is
    charged once (15 + 15 = 30 < 31; charged twice it would be 45)."""
    released, stalled, go_on = asyncio.Event(), asyncio.Event(), asyncio.Event()
    deliveries: list[int] = []
    calls: list[int] = []

    async def hook(name: str) -> None:
        if name == "model_pending" and len(calls) == 1 and not stalled.is_set():
            stalled.set()
            await released.wait()

    async def turn(tc: TaskContext) -> None:
        deliveries.append(tc.delivery)
        j = await tc.journal()

        async def call() -> WithUsage:
            calls.append(tc.delivery)
            return WithUsage({"delivery": tc.delivery}, CALL)

        await j.model(call)
        if tc.delivery == 1:
            await tc.complete("the zombie")  # fenced: the second delivery holds the step
            return
        await go_on.wait()
        await j.model(call)
        await tc.complete("the successor")

    async def fence_the_first(run_id: str) -> None:
        await wait_for(lambda: len(calls) >= 2, timeout=30)  # the successor called
        released.set()

        async def fenced() -> bool:
            return (await client.run_usage(run_id)).total.fenced.calls == 1

        await wait_for(fenced, timeout=20)
        go_on.set()

    seam.install(hook)
    try:
        run = await run_loop(
            client,
            engine,
            turn,
            budget=Budget(tokens=31),
            until=fence_the_first,
            heartbeat_interval=NO_HEARTBEAT,
        )
    finally:
        seam.install(None)
        released.set()
    assert run.status == pb.RUN_STATUS_COMPLETED and json.loads(run.output) == "the successor"
    assert calls == [1, 2, 2]
    usage = await client.run_usage(run.run_id)
    total = usage.total
    assert (total.kept.calls, total.fenced.calls, total.spent.calls) == (2, 1, 3)
    assert total.spent.input_tokens == 30 and total.spent.output_tokens == 15
    assert list((await journal_check(engine, run.run_id)).violations) == []
