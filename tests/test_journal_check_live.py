"""``journal check`` on a loop while it runs: the run it audits against is the
run now, caught up with the journal, so a healthy loop is never reported.

A loop on a kept task has iterations the engine decided and has not written
to the runs bucket yet; an audit that compared the bucket with the journal
reported them as missing iterations. Polled throughout a loop of fast turns,
the audit finds nothing, and neither do the other readers of the run now:
``GetRun`` never shows fewer iterations than the journal had committed
before it was asked.
"""

from __future__ import annotations

import asyncio

from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk import Client, TaskContext, Worker
from tests.stack import loop_workflow, steps_by_id, unique
from tests.test_journal import journal_check, read_journal

ITERATIONS = 200
TURN = 0.02  # seconds of work in each turn


def continues(records: list[jpb.Record]) -> int:
    return sum(
        1 for r in records if r.HasField("commit") and r.commit.action == jpb.ACTION_CONTINUE
    )


async def turn(tc: TaskContext) -> None:
    await tc.journal()
    done = await tc.load_checkpoint() or 0
    await asyncio.sleep(TURN)  # the turn's work
    if done + 1 >= ITERATIONS:
        await tc.complete(done + 1)
        return
    await tc.checkpoint(done + 1)
    await tc.continue_()


async def test_journal_check_polled_through_a_loop_of_fast_turns_finds_nothing(
    engine: EngineServer, client: Client
) -> None:
    task, name = unique("live"), unique("livewf")
    await client.register_workflow(loop_workflow(name, task, max_iterations=ITERATIONS + 5))
    async with Worker(engine.target, handlers={task: turn}, poll_wait=1.0):
        run = await client.start_run(name)
        checks, violations, behind = 0, list[str](), list[tuple[int, int]]()
        status = pb.RUN_STATUS_RUNNING
        while status == pb.RUN_STATUS_RUNNING:
            found = await journal_check(engine, run.run_id)
            checks += 1
            violations.extend(f"{v.rule}: {v.message}" for v in found.violations)
            committed = continues(await read_journal(engine, run.run_id))
            now = await client.get_run(run.run_id)
            status = now.status
            shown = steps_by_id(now)["agent"].iterations
            if status == pb.RUN_STATUS_RUNNING and shown + 1 < committed:
                # The newest continue may still be on its way to the engine.
                behind.append((shown, committed))
        final = await client.wait_for_run(run.run_id, timeout=60)
    assert final.status == pb.RUN_STATUS_COMPLETED, final.error
    assert steps_by_id(final)["agent"].iterations == ITERATIONS - 1
    assert checks >= 20, f"only {checks} checks ran while the loop did"
    assert violations == [], f"{len(violations)} violations in {checks} checks: {violations[:3]}"
    assert behind == [], f"GetRun behind the journal: {behind[:3]}"
    assert list((await journal_check(engine, run.run_id)).violations) == []
