"""Crash seams: named points where a crash leaves different durable state.

The SDK, the journal service and the engine call ``await seam("name")`` at
each such boundary. Production installs no hook, and a seam is then one
attribute check. Tests install a hook to stall or stop the holder right
there (see ``tests/README.md``); this module is internal, not public API.

Seams: ``before_claim``, ``after_claim``, ``model_pending`` (a model answered;
its response waits to ride the next journal call), ``after_model`` (a response
stored in a record of its own), ``after_intent`` (an intent stored, with the
response that asked for it when that rode along), ``result_pending`` (a tool
returned; its result waits to ride the commit), ``after_result`` (a result
stored in a record of its own), ``after_group_intents`` (every intent of a
parallel group stored, none of its calls started), ``after_group_result``
(one result of a parallel group stored; its other calls may be running),
``after_inputs_placed``,
``after_approval_intent`` (a call needing approval stored its ask, not yet
answered ``awaiting_approval``), ``after_approval_placed`` (the step's
approval inputs placed by the dispatch's first call needing one, the call not
yet made), ``approved_tool_returned`` (an approved tool returned, its result
stored nowhere), ``after_event`` (the
task is settled, or its commit answered, with a pending entry that rode it);
in the journal service ``before_inputs_listed`` (a ``PlaceInputs`` writer was
checked current, the step's inputs not yet listed), ``after_input_claimed``
(an input is claimed in its bucket, its ``input.placed`` record not yet written) and
``after_commit_stored`` (a commit that settles its task stored and
answered, its event not yet published; a commit that keeps its task for the
next iteration is not answered yet), ``after_commit_event_sent`` (a commit's
event sent to the engines over core NATS, or about to be handed to the engine
of the same process, no answer come, nothing of it on the history; its task
not released) and ``after_kept_decision`` (the engine's decision known, the
worker not yet answered); and in the engine ``after_dispatch_saved`` (a dispatch is
saved, its task not yet published; a new run's first tasks are published
while it is written, so there both are stored), ``after_dispatch_published``
(its task published, the outbox left in the run for the next write to
replace), ``before_first_tasks`` (a new run's first tasks about to be
published while the run is written: raising here stores the run alone),
``after_kept_unwritten`` (a kept iteration decided and not written: the run
as stored is behind the journal: the deferred write), ``before_event_applied`` (an event is
taken from the history, or a commit's event from core NATS, not yet applied
nor acknowledged), ``after_upgrade_stored`` (a run moved to another build
is stored, its steps' old lanes not yet purged) and ``after_moved_to_lane``
(a message off its pinned step's lane dispatched again on the lane, the
message not yet acknowledged).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

Hook = Callable[[str], Awaitable[None]]

_hook: Hook | None = None


async def seam(name: str) -> None:
    """Give an installed hook control at boundary ``name``; nothing otherwise."""
    if _hook is not None:
        await _hook(name)


def install(hook: Hook | None) -> None:
    """Install ``hook`` for every seam of this process (None removes it)."""
    global _hook
    _hook = hook
