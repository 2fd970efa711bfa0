"""The usage counters of a journal service, by workflow and model, for
Prometheus (served with the process's other counters, ``--metrics-port``).

Counted as each model record with a usage is stored (and each fenced call's
usage on the spent subject), in this process: a counter of one process, as
Prometheus counters are; the ledger in the journal is the truth. A record
names its run, not its workflow: the run's workflow is read once per run
(the run now) and kept for the ``RUNS`` runs counted last, behind the answer
and off the record's path, so a run's iterations read nothing for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict

from dagnats.core import errors
from dagnats.journal.peers import Runs
from dagnats.journal.v1 import journal_pb2 as pb

log = logging.getLogger(__name__)

RUNS = 4096  # runs whose workflow the meter keeps
KINDS = ("input", "output", "cached")


class UsageMeter:
    """Calls, tokens by kind and cost (micros), by (workflow, model)."""

    def __init__(self, runs: Runs) -> None:
        self._runs = runs
        self._workflows: OrderedDict[str, str] = OrderedDict()
        self._reading: set[asyncio.Task[None]] = set()
        self.calls: Counter[tuple[str, str]] = Counter()
        self.tokens: Counter[tuple[str, str, str]] = Counter()
        self.cost_micros: Counter[tuple[str, str]] = Counter()

    def count(self, run_id: str, usage: pb.Usage) -> None:
        """Count a stored call's usage, now when the run's workflow is known,
        else once it was read."""
        workflow = self._workflows.get(run_id)
        if workflow is not None:
            self._add(workflow, usage)
            return
        reading = asyncio.ensure_future(self._read_then_add(run_id, usage))
        self._reading.add(reading)
        reading.add_done_callback(self._reading.discard)

    async def _read_then_add(self, run_id: str, usage: pb.Usage) -> None:
        workflow = ""
        try:
            run = await self._runs.get_run(run_id)
            workflow = run.workflow if run is not None else ""
        except errors.DagnatsError as err:  # counted under no workflow, not lost
            log.debug("the workflow of run %s was not read for its usage: %s", run_id, err)
        self._workflows[run_id] = workflow
        self._workflows.move_to_end(run_id)
        while len(self._workflows) > RUNS:
            self._workflows.popitem(last=False)
        self._add(workflow, usage)

    def _add(self, workflow: str, usage: pb.Usage) -> None:
        key = (workflow, usage.model)
        self.calls[key] += 1
        for kind, value in zip(
            KINDS, (usage.input_tokens, usage.output_tokens, usage.cached_tokens), strict=True
        ):
            self.tokens[(*key, kind)] += value
        self.cost_micros[key] += usage.cost_micros
