"""Two runs read for their diff (``dagnats.sdk.diff``): each run and the
records of each of its steps' journals, through the SDK's clients. The
gateway's ``GET /runs/{a}/diff/{b}`` and ``dagnats run diff`` call it."""

from __future__ import annotations

from typing import Any

from dagnats.sdk import Client, JournalClient
from dagnats.sdk.diff import diff_runs
from dagnats.sdk.views import record_dict, run_dict

# The most records of one step read for a diff.
MAX_RECORDS = 5000


async def run_diff(client: Client, journal: JournalClient, a: str, b: str) -> dict[str, Any]:
    """The diff of runs ``a`` and ``b`` (see ``dagnats.sdk.diff.diff_runs``).

    Raises:
        NotFound: either run does not exist.
    """
    run_a, run_b = await client.get_run(a), await client.get_run(b)
    return diff_runs(
        run_dict(run_a),
        run_dict(run_b),
        await _journals(journal, run_a.run_id, [s.step_id for s in run_a.steps]),
        await _journals(journal, run_b.run_id, [s.step_id for s in run_b.steps]),
    )


async def _journals(
    journal: JournalClient, run_id: str, steps: list[str]
) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for step in steps:
        records = [record_dict(r) async for r in journal.read(run_id, step, limit=MAX_RECORDS)]
        if records:
            found[step] = records
    return found
