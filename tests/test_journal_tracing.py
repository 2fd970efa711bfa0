"""A fenced write is a span event with the expected and actual sequence, in
the trace of the zombie's own iteration."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dagnats.engine.server import start_engine
from dagnats.sdk import Client
from tests.journal_agent import ConversationModel, Crasher, Seen, Tools, agent
from tests.stack import FAST, loop_workflow, unique
from tests.test_journal import fenced_after_stall


async def test_fenced_write_is_a_span_event_in_the_zombies_trace(
    nats_server: Any, span_exporter: InMemorySpanExporter
) -> None:
    engine = await start_engine(nats_server.url, config=FAST)
    task, name = unique("tj"), unique("twf")
    model, tools, seen = ConversationModel(), Tools(), Seen()
    handler = agent(model, tools, seen)
    try:
        async with Client(engine.target) as client:
            await client.register_workflow(loop_workflow(name, task))
            with Crasher("model_pending", skip=1) as stall:
                await fenced_after_stall(
                    client,
                    engine,
                    task,
                    name,
                    handler,
                    seen,
                    stall,
                    iteration=1,
                    then=lambda run_id: client.wait_for_run(run_id, timeout=30),
                )
    finally:
        await engine.stop()

    spans = list(span_exporter.get_finished_spans())
    fenced = [(span, event) for span in spans for event in span.events if event.name == "fenced"]
    assert fenced, "the fenced write left a span event"
    span, event = fenced[0]
    assert event.attributes is not None
    expected, actual = event.attributes["expected_seq"], event.attributes["actual_seq"]
    assert isinstance(expected, int) and isinstance(actual, int) and actual > expected
    zombie_turns = [
        s
        for s in spans
        if s.name == f"task {task}"
        and s.attributes is not None
        and s.attributes.get("iteration") == 1
        and s.context.trace_id == span.context.trace_id
    ]
    assert zombie_turns, "the event is in the trace of the zombie's iteration"
    # That trace began at the engine, which dispatched the iteration.
    ids = {s.context.span_id: s for s in spans}
    node = zombie_turns[0]
    while node.parent is not None and node.parent.span_id in ids:
        node = ids[node.parent.span_id]
    assert node.name.startswith("dagnats.engine.v1.EngineService/StartRun")
