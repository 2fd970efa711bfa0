"""Journal commits and the engine outcomes they stand for, both ways.

A worker settles a journaled task with a commit; the lifecycle event that
follows carries the same outcome to the engine. The SDK, the HTTP bridge, the
journal service (which publishes the event of a commit that settles its task)
and the engine (which checks a report against the commit it names) convert
here, so one commit always means one outcome, and a claim answered
``settled`` is reported the same way by every worker.
"""

from __future__ import annotations

from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.journal.v1 import journal_pb2 as jpb

Outcome = pb.Continue | pb.Complete | pb.Fail | pb.Pause


def commit_of(outcome: Outcome, state: bytes | None) -> jpb.Commit:
    """The journal commit that stores ``outcome`` with ``state`` (JSON; None keeps
    no state)."""
    commit = jpb.Commit(has_state=state is not None, state=state or b"")
    match outcome:
        case pb.Continue(output=output):
            commit.action, commit.output = jpb.ACTION_CONTINUE, output
            if outcome.HasField("wait"):
                wait = outcome.wait
                if wait.HasField("delay"):
                    commit.wait_delay.CopyFrom(wait.delay)
                if wait.HasField("until"):
                    commit.wait_until.CopyFrom(wait.until)
                commit.wait_until_input = wait.until_input
        case pb.Complete(output=output):
            commit.action, commit.output = jpb.ACTION_COMPLETE, output
        case pb.Fail(error=error, kind=kind, reason=reason):
            permanent = kind == pb.FAILURE_KIND_PERMANENT
            commit.action = jpb.ACTION_FAIL_PERMANENT if permanent else jpb.ACTION_FAIL
            commit.error, commit.reason = error, reason
        case pb.Pause(duration=duration):
            commit.action = jpb.ACTION_PAUSE
            commit.pause.CopyFrom(duration)
    return commit


def outcome_of(commit: jpb.Commit) -> tuple[str, Outcome]:
    """The outcome a stored commit reports to the engine, and its field name in
    ``ReportRequest`` and ``HistoryEvent`` ("continue", "complete", "fail", "pause")."""
    if commit.action == jpb.ACTION_CONTINUE:
        cont = pb.Continue(output=commit.output)
        if (
            commit.HasField("wait_delay")
            or commit.HasField("wait_until")
            or commit.wait_until_input
        ):
            if commit.HasField("wait_delay"):
                cont.wait.delay.CopyFrom(commit.wait_delay)
            if commit.HasField("wait_until"):
                cont.wait.until.CopyFrom(commit.wait_until)
            cont.wait.until_input = commit.wait_until_input
        return "continue", cont
    if commit.action == jpb.ACTION_COMPLETE:
        return "complete", pb.Complete(output=commit.output)
    if commit.action == jpb.ACTION_PAUSE:
        return "pause", pb.Pause(duration=commit.pause)
    permanent = commit.action == jpb.ACTION_FAIL_PERMANENT
    kind = pb.FAILURE_KIND_PERMANENT if permanent else pb.FAILURE_KIND_RETRIABLE
    return "fail", pb.Fail(error=commit.error, kind=kind, reason=commit.reason)


def settled_report(
    settled: jpb.Settled, *, lease: str, run_id: str, step_id: str, iteration: int, attempt: int
) -> pb.ReportRequest:
    """What settles a task (``iteration``, ``attempt``) whose claim the journal
    answered ``settled``: a stale task is acknowledged; a stored commit
    (committed before a crash, or the restart limit's failure) is reported
    again, under its own dispatch."""
    request = pb.ReportRequest(lease=lease, run_id=run_id, step_id=step_id)
    if settled.reason == "stale":
        request.iteration, request.attempt = iteration, attempt
        request.acknowledge.SetInParent()
        return request
    commit = settled.commit
    request.iteration, request.attempt = commit.iteration, commit.attempt
    request.journal_seq = commit.seq
    field, outcome = outcome_of(commit.commit)
    getattr(request, field).CopyFrom(outcome)
    return request
