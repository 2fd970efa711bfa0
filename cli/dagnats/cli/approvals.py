"""``dagnats run approvals|approve|deny``: approvals of tool calls from a terminal.

``approvals RUN --step S`` lists the calls waiting for approval with their
arguments and digests. ``approve RUN --step S --call K`` approves the call
``K`` for the digest given with ``--digest`` (the one listed); without it,
for the digest of the call as it waits now, whose arguments are printed
first. ``--args JSON`` approves edited arguments instead. ``deny`` takes
``--reason``, which reaches the model as the tool's result. A digest that is
not the call's is refused (exit 1, with the reason) and changes nothing.
The checks are the approvals edge's (``dagnats.gateway.approvals``).
"""

from __future__ import annotations

import argparse
import getpass
import json
from typing import Any

from dagnats.cli.common import UsageError, dumps
from dagnats.core.errors import NotFound
from dagnats.sdk import Client, JournalClient


def add_approval_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    with_client_options: Any,
) -> None:
    """Add ``approvals``, ``approve`` and ``deny`` to ``dagnats run``."""
    listing = with_client_options(sub.add_parser("approvals", help="list calls waiting approval"))
    listing.add_argument("run_id")
    listing.add_argument("--step", required=True, help="the step whose calls to list")
    for name, what in (("approve", "approve a tool call"), ("deny", "deny a tool call")):
        p = with_client_options(sub.add_parser(name, help=what))
        p.add_argument("run_id")
        p.add_argument("--step", required=True)
        p.add_argument("--call", required=True, help="the call's key, as listed")
        p.add_argument("--digest", default="", help="the digest approved (default: as listed)")
        p.add_argument("--reason", default="", help="why; a denial's reaches the model")
        p.add_argument("--approver", default="", help="who decides (default: the user)")
        p.add_argument("--request-id", default="", help="an id; a repeat is one decision")
    sub.choices["approve"].add_argument("--args", default=None, help="edited arguments as JSON")


async def run_approvals(args: argparse.Namespace, client: Client, journal: JournalClient) -> int:
    """Run ``approvals``, ``approve`` or ``deny``; returns the exit code."""
    from dagnats.gateway import approvals  # the edge's checks, loaded when used

    if args.action == "approvals":
        waiting = await approvals.waiting(journal, args.run_id, args.step)
        if args.json:
            print(dumps(waiting))
        for call in [] if args.json else waiting:
            print(f"{call['call']}  {call['tool']}  {call['digest']}")
            print(f"    {json.dumps(call['args'], ensure_ascii=False)}")
        if not waiting and not args.json:
            print(f"no call of step {args.step} waits for approval")
        return 0
    digest = args.digest or await _listed_digest(journal, args)
    edited = getattr(args, "args", None) is not None
    act = approvals.act(
        args.run_id,
        args.step,
        call=args.call,
        digest=digest,
        approve=args.action == "approve",
        approver=args.approver or getpass.getuser(),
        reason=args.reason,
        args=_parse_args(args.args) if edited else None,
        edited=edited,
    )
    decided = await approvals.decide(
        client, journal, args.run_id, args.step, act, request_id=args.request_id
    )
    if args.json:
        print(dumps(decided.to_dict()))
    else:
        verb = "denied" if args.action == "deny" else "approved"
        print(f"{verb} {decided.decision.key} with digest {decided.decision.digest}")
    return 0


async def _listed_digest(journal: JournalClient, args: argparse.Namespace) -> str:
    """The digest of the call as it waits now; its arguments are printed."""
    from dagnats.gateway import approvals

    for call in await approvals.waiting(journal, args.run_id, args.step):
        if call["call"] == args.call:
            print(f"{call['tool']} {json.dumps(call['args'], ensure_ascii=False)}")
            return str(call["digest"])
    raise NotFound(f"no tool call {args.call!r} of step {args.step} waits for approval")


def _parse_args(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError as err:
        raise UsageError(f"--args is not JSON: {err}") from None
