"""One trace follows a run: start, dispatch, the worker's handler, the report,
the engine applying it, and the next dispatch."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dagnats.engine.server import start_engine
from dagnats.sdk import Client, TaskContext, Worker
from tests.helpers import wait_for
from tests.stack import FAST, loop_workflow, unique


async def test_one_trace_from_start_to_next_dispatch(
    nats_server: Any, span_exporter: InMemorySpanExporter
) -> None:
    engine = await start_engine(nats_server.url, config=FAST)
    task, name = unique("traced"), unique("wf")

    async def handler(tc: TaskContext) -> None:
        if tc.iteration == 1:
            await tc.complete("done")
        else:
            await tc.continue_()

    try:
        async with Client(engine.target) as client:
            await client.register_workflow(loop_workflow(name, task))
            span_exporter.clear()
            async with Worker(engine.target, handlers={task: handler}, poll_wait=1.0):
                run = await client.start_run(name)
                await client.wait_for_run(run.run_id, timeout=20)
    finally:
        await engine.stop()

    def spans() -> list[Any]:
        return list(span_exporter.get_finished_spans())

    await wait_for(lambda: sum(s.name == f"task {task}" for s in spans()) == 2, timeout=10)
    by_name: dict[str, list[Any]] = {}
    for span in spans():
        by_name.setdefault(span.name, []).append(span)
    start = next(
        s for s in by_name["dagnats.engine.v1.EngineService/StartRun"] if s.kind.name == "SERVER"
    )
    trace_id = start.context.trace_id
    handlers = by_name[f"task {task}"]
    assert [h.context.trace_id for h in handlers] == [trace_id, trace_id]
    applied = by_name["engine apply continue"]
    assert any(s.context.trace_id == trace_id for s in applied)
    reports = [
        s
        for s in by_name["dagnats.engine.v1.EngineService/Report"]
        if s.kind.name == "SERVER" and s.context.trace_id == trace_id
    ]
    assert len(reports) == 2, "both reports belong to the run's trace"
    # The second handler descends from the engine applying the first continue.
    ids = {s.context.span_id: s for s in spans()}
    node = handlers[-1] if handlers[-1].start_time > handlers[0].start_time else handlers[0]
    ancestors = []
    while node.parent is not None and node.parent.span_id in ids:
        node = ids[node.parent.span_id]
        ancestors.append(node.name)
    assert "engine apply continue" in ancestors
    assert ancestors[-1] == "dagnats.engine.v1.EngineService/StartRun"
