"""The JournalService servicer: validates requests, reads what the replay
rules need, asks :mod:`dagnats.journal.replay`, and writes what they say.

It keeps no state a replica could not rebuild: a writer's view travels in its
token, and the replay snapshot (the iteration's records as the claim found
them) is cached only as an optimisation and re-read on a miss. Every record
is written by :mod:`dagnats.journal.writer`; input placement lives in
:mod:`dagnats.journal.placement`, and the Session stream in
:mod:`dagnats.journal.session`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, assert_never

from dagnats.core import errors, statechain
from dagnats.core.approvals import call_digest, is_digest
from dagnats.core.budget_wire import check_budget
from dagnats.core.grpcutil import Context, abort_with, domain_errors
from dagnats.core.ids import check_build_id, check_lease, check_run_id, check_token, check_worker_id
from dagnats.core.payload import check_json
from dagnats.core.seam import seam
from dagnats.core.settings import env_int, env_seconds
from dagnats.core.usage import Policy, Prices, Usage, parse_prices, price
from dagnats.engine.v1 import engine_pb2 as epb
from dagnats.inputs.store import InputStore
from dagnats.journal import audit, convert, ledger, replay, session, state, stream
from dagnats.journal import model as jm
from dagnats.journal.fork import prefix_digest
from dagnats.journal.group import ParallelGroups
from dagnats.journal.limits import MAX_ANSWER_BYTES
from dagnats.journal.meter import UsageMeter
from dagnats.journal.peers import Runs, Tasks
from dagnats.journal.placement import MODES, InputPlacement
from dagnats.journal.store import JournalStore
from dagnats.journal.usage import RunLedgers
from dagnats.journal.v1 import journal_pb2 as pb
from dagnats.journal.v1 import journal_pb2_grpc as pb_grpc
from dagnats.journal.writer import JournalWriter, cancelled

log = logging.getLogger(__name__)

# Calls (model, tool, place-inputs) one dispatch may journal; a step that needs
# more has outgrown a per-step journal (the spec's "bounded calls per iteration").
MAX_POSITIONS = 1000
# Calls of one parallel group: as many as one model response asks for.
MAX_GROUP_CALLS = 128
MAX_RESTART_LIMIT = 1000
MAX_PAGE = 1000
# Steps whose latest holder a replica remembers for refusing fenced chunks;
# past it the oldest is forgotten (the watchers' rules still drop its chunks).
MAX_HOLDERS = 100_000
# What a step's state may grow to (the state chain): a commit of a larger one
# is refused with its size.
STATE_MAX_BYTES = env_int("DAGNATS_STATE_MAX_BYTES", statechain.STATE_MAX_BYTES)
# A claim's answer carries a state up to this size; a larger one is read with
# ReadState.
STATE_IN_ANSWER = MAX_ANSWER_BYTES // 2
# Seconds a stopping service waits for the settles it owes.
SETTLE_GRACE = env_seconds("DAGNATS_SETTLE_GRACE", 10.0)
# The commit wait: longest a commit waits for the engine's decision on its
# event, a third by its route, the rest on the history. A commit that keeps
# its task answers without the next dispatch when none came: its task
# message waits out its lease and is delivered carrying what the run then
# says.
EVENT_WAIT = env_seconds("DAGNATS_EVENT_WAIT", 3.0)
_WRITER_HEX = frozenset("0123456789abcdef")
# Steps whose newest continue commit the engine may not have applied: it is
# in flight, or a cancel dropped it.
_SETTLING = frozenset({epb.STEP_STATUS_RUNNING, epb.STEP_STATUS_CANCELLED})


def check_position(position: int) -> int:
    if not 0 <= position < MAX_POSITIONS:
        raise errors.InvalidArgument(
            f"position must be 0..{MAX_POSITIONS - 1}: one dispatch journals at most "
            f"{MAX_POSITIONS} calls",
            field="position",
        )
    return position


def check_writer_token(token: pb.WriterToken) -> pb.WriterToken:
    check_run_id(token.run_id, field="token.run_id")
    check_token(token.step_id, field="token.step_id")
    if len(token.writer) != 16 or not set(token.writer) <= _WRITER_HEX:
        raise errors.InvalidArgument("token.writer is not a writer nonce", field="token.writer")
    if token.iteration < 0 or token.attempt < 1:
        raise errors.InvalidArgument("token names no dispatch", field="token")
    check_worker_id(token.claim.worker_id, field="token.claim.worker_id")
    check_build_id(token.build_id, field="token.build_id")
    return token


def _check_intent_seq(token: pb.WriterToken, intent_seq: int, field: str = "intent_seq") -> None:
    """An output or result answers a record of this iteration that the writer
    has seen: after the iteration's base, not after the writer's tail."""
    if not token.base_seq < intent_seq <= token.last_seq:
        raise errors.InvalidArgument(
            f"{field} {intent_seq} is no record of iteration {token.iteration} this "
            f"writer has seen ({token.base_seq + 1}..{token.last_seq})",
            field=field,
        )


class JournalServicer(pb_grpc.JournalServiceServicer):
    """The journal's gRPC methods. ``runs`` and ``tasks`` are the engine's
    (see :mod:`dagnats.journal.peers`); ``inputs`` is the inputs' store, for
    placing inputs; ``clock`` stamps records and the inputs placed."""

    def __init__(
        self,
        store: JournalStore,
        runs: Runs,
        inputs: InputStore | None = None,
        *,
        tasks: Tasks,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.inputs = inputs
        self._runs = runs
        self._tasks = tasks
        self._writer = JournalWriter(store, clock=clock)
        self._settling: set[asyncio.Task[None]] = set()
        self._placement = InputPlacement(self._writer, inputs) if inputs is not None else None
        self._groups = ParallelGroups(self._writer, self._store_model)
        # The writer of the newest claim this replica made, per step: a chunk of
        # any other writer is a fenced holder's and is refused.
        self._holders: dict[tuple[str, str], str] = {}
        self._state_max_bytes = STATE_MAX_BYTES
        # The price table a model call's usage is priced with (the usage
        # ledger); a bad one stops the service from starting, naming it.
        self._prices: Prices = parse_prices(os.environ.get("DAGNATS_PRICES", ""))
        self._ledgers = RunLedgers(store)
        self.meter = UsageMeter(runs)

    # ---- claim ---------------------------------------------------------------------

    @domain_errors
    async def Claim(self, request: pb.ClaimRequest, context: Context) -> pb.ClaimResponse:
        check_run_id(request.run_id)
        check_token(request.step_id, field="step_id")
        if request.iteration < 0:
            raise errors.InvalidArgument("iteration must be >= 0", field="iteration")
        if request.attempt < 1:
            raise errors.InvalidArgument("attempt must be >= 1", field="attempt")
        if request.delivery < 0:
            raise errors.InvalidArgument("delivery must be >= 0 (0: not known)", field="delivery")
        check_worker_id(request.worker_id)
        check_build_id(request.build_id)
        limit = request.restart_limit or replay.DEFAULT_RESTART_LIMIT
        if not 1 <= limit <= MAX_RESTART_LIMIT:
            raise errors.InvalidArgument(
                f"restart_limit must be 1..{MAX_RESTART_LIMIT}", field="restart_limit"
            )
        lease = check_lease(request.lease) if request.lease else ""
        response = await self._claim(request, _asked(request, limit, with_lease=False))
        if lease and response.HasField("settled"):
            # As a commit with a lease: answer, then settle behind it.
            self._behind_answer(self._settle_claimed(lease, response.settled))
            response.settled.task_settled = True
        return response

    async def claim_with_lease(
        self, request: pb.ClaimRequest, *, first: bool = False
    ) -> pb.Claimed | None:
        """The claim with the lease: the claim of a task's first delivery,
        made as the engine of this process leases it (ADR 42). What ``Claim``
        would answer when the claim rides the holder's first record (ADR 40),
        with nothing written; None when it would be stored or would settle
        the task, which the holder's own ``Claim`` then does.

        ``first``: the engine knows the run running and the task the first
        delivery of its step's first dispatch, whose journal then holds
        nothing: the claim reads nothing either (ADR 50). Were a record there
        after all, the holder's first record, fenced on an empty tail, would
        be refused."""
        limit = request.restart_limit or replay.DEFAULT_RESTART_LIMIT
        asked = _asked(request, limit, with_lease=True, first_dispatch=first)
        response = await self._claim(request, asked)
        return response.claimed if response.HasField("claimed") else None

    async def _claim(self, request: pb.ClaimRequest, asked: replay.ClaimAsked) -> pb.ClaimResponse:
        """The claim's answer, one step at a time as ``replay.claim_step``
        says; an empty answer when a claim with the lease leaves the claim to
        its holder (``NoClaim``)."""
        run_id, step_id = request.run_id, request.step_id
        # The commit that ended the last iteration, as this replica stored it,
        # is the likely tail: the guessed tail.
        guessed_tail = self._writer.last_commit(run_id, step_id)
        if guessed_tail is not None:
            asked = dataclasses.replace(asked, guessed_tail=guessed_tail.iteration)
        seen = replay.ClaimSeen()
        tail: pb.Record | None = None
        records: list[pb.Record] = []
        while True:
            step = replay.claim_step(asked, seen)
            match step:
                case replay.ReadTail(with_run=with_run):
                    tail, ended = await self._tail(run_id, step_id, with_run=with_run)
                    seen, records = replay.ClaimSeen(tail=_entries(tail), run_ended=ended), []
                case replay.UseGuessedTail():
                    tail = guessed_tail
                    seen = replay.ClaimSeen(tail=_entries(tail), guessed=True)
                case replay.ReadRecords(base=base, through=through):
                    found = await self.store.read(run_id, step_id, after=base, through=through)
                    records = [r for r in found if r.iteration == request.iteration]
                    seen = dataclasses.replace(seen, records=tuple(convert.all_entries(records)))
                case replay.RideFirstRecord(base=base):
                    return await self._claim_riding(request, tail, base)
                case replay.StoreClaim(base=base, close=close, guessed=guessed):
                    stored = await self._store_claim(request, tail, base, guessed=guessed)
                    if stored is None:  # the guessed tail was wrong, and nothing was written
                        seen = dataclasses.replace(seen, guess_missed=True)
                    else:
                        entries = [*(seen.records or ()), convert.entry(stored[1])]
                        return await self._close_earlier(
                            stored[0], tail, base, [*records, stored[1]], entries, close
                        )
                case replay.RestartLimit(base=base, guessed=guessed):
                    stored = await self._store_claim(request, tail, base, guessed=guessed)
                    if stored is None:  # the guessed tail was wrong, and nothing was written
                        seen = dataclasses.replace(seen, guess_missed=True)
                    else:
                        return await self._fail_at_restart_limit(stored[0], asked.limit)
                case replay.Stale(detail=detail):
                    return _settled("stale", detail=detail)
                case replay.AlreadyCommitted(commit=commit):
                    committed = next(r for r in records if r.seq == commit.seq)
                    return _settled("committed", commit=committed, detail="already committed")
                case replay.Cancelled(reason=reason):
                    # The run's end sealed the journal.
                    raise cancelled(_claimant(request, tail, 0), reason)
                case replay.NoClaim():
                    return pb.ClaimResponse()
                case _:
                    assert_never(step)

    async def _tail(
        self, run_id: str, step_id: str, *, with_run: bool
    ) -> tuple[pb.Record | None, str]:
        """The step's tail; with ``with_run``, also how the run ended (empty
        while it runs), the two read at once."""
        if not with_run:
            return await self.store.tail(run_id, step_id), ""
        run, tail = await asyncio.gather(self._run(run_id), self.store.tail(run_id, step_id))
        status = epb.RunStatus.Name(run.status).removeprefix("RUN_STATUS_").lower()
        return tail, f"run {run_id} is {status}" if run.status != epb.RUN_STATUS_RUNNING else ""

    async def _store_claim(
        self, request: pb.ClaimRequest, tail: pb.Record | None, base: int, *, guessed: bool
    ) -> tuple[pb.WriterToken, pb.Record] | None:
        """Append the claim after ``tail`` (the guessed tail, with ``guessed``):
        the new holder's token and the claim as stored; None when the guessed
        tail was wrong, and nothing was written."""
        token = _claimant(request, tail, base)
        claim = pb.Record(claim=pb.Claim(delivery=request.delivery, worker_id=request.worker_id))
        write = self._writer.append_on_guessed_tail if guessed else self._writer.append
        stored = await write(token, claim)
        if stored is not None:
            await self._now_holding(stored[0])
        return stored

    async def _fail_at_restart_limit(self, token: pb.WriterToken, limit: int) -> pb.ClaimResponse:
        """Commit the restart limit's retriable failure after the claim."""
        failure = pb.Commit(
            action=pb.ACTION_FAIL,
            error=f"restart limit: {limit} deliveries in a row without progress",
            reason="restart_limit",
        )
        token, commit = await self._writer.append(token, pb.Record(commit=failure))
        return _settled("restart_limit", commit=commit, detail=failure.error)

    async def _close_earlier(
        self,
        token: pb.WriterToken,
        tail: pb.Record | None,
        base: int,
        records: list[pb.Record],
        entries: list[jm.AnyEntry],
        close: tuple[jm.IntentEntry, ...],
    ) -> pb.ClaimResponse:
        """After the claim, answer the earlier attempts' intents ``close`` as
        interrupted; then the claim's answer. ``records`` (``entries``) are
        the iteration's, the claim last."""
        for intent in close:
            interrupted = pb.ToolResult(
                intent_seq=intent.seq,
                intent_index=intent.index,
                interrupted=True,
                partial=replay.partial_output(entries, intent.seq, intent.index),
            )
            token, closed = await self._writer.append(token, pb.Record(tool_result=interrupted))
            records.append(closed)
            entries.append(convert.entry(closed))
        return await self._claimed(token, tail, base, records, entries)

    async def _claim_riding(
        self, request: pb.ClaimRequest, tail: pb.Record | None, base: int
    ) -> pb.ClaimResponse:
        """Claim the dispatch without a write: nothing of its iteration is
        stored, and the claim has nothing to fence, close or count, so the
        holder's first record stores it, fenced on ``tail`` (ADR 40)."""
        token = _claimant(request, tail, base)
        token.claim.CopyFrom(pb.Claim(delivery=request.delivery, worker_id=request.worker_id))
        await self._now_holding(token)
        return await self._claimed(token, tail, base, [], [])

    async def _claimed(
        self,
        token: pb.WriterToken,
        tail: pb.Record | None,
        base: int,
        records: list[pb.Record],
        entries: list[jm.AnyEntry],
    ) -> pb.ClaimResponse:
        """The answer of a claim that proceeds: ``token``'s writer holds the
        step, and ``records`` (``entries``) are the iteration's so far."""
        token.snapshot_seq = token.last_seq
        token.replay_positions = replay.replay_positions(entries)
        self._writer.remember(token, entries)
        claimed = pb.Claimed(token=token)
        if not base:
            previous = None
        elif tail is not None and tail.seq == base:
            previous = tail  # the usual case: the tail is the commit that ended the last turn
        else:
            previous = await self.store.get(base)
        if previous is not None and previous.commit.has_state:
            await self._claimed_state(claimed, previous)
        _page(claimed, records)
        return pb.ClaimResponse(claimed=claimed)

    async def _claimed_state(self, claimed: pb.Claimed, previous: pb.Record) -> None:
        """The state of ``previous``, the commit that ended the iteration before,
        into ``claimed``: rebuilt from its chain (one snapshot and the deltas
        after it), and left for ReadState when the answer would not hold it."""
        claimed.has_state = True
        claimed.state_chain.CopyFrom(state.chain_of(previous.commit))
        if claimed.state_chain.size > STATE_IN_ANSWER:
            # Too large for the answer: the holder may hold it already (the
            # worker keeps it), else reads it with ReadState; not rebuilt here.
            claimed.state_follows = True
            return
        found = await state.state_at(self.store, previous)
        assert found is not None  # previous carried a state
        claimed.state = found.state

    async def _now_holding(self, token: pb.WriterToken) -> None:
        """``token``'s writer holds its step from ``token.last_seq`` on: its
        chunks are the ones shown, and the live preview is told, which ends the
        previous holder's open streams."""
        key = (token.run_id, token.step_id)
        self._holders.pop(key, None)
        self._holders[key] = token.writer  # newest last: the oldest goes first
        if len(self._holders) > MAX_HOLDERS:
            del self._holders[next(iter(self._holders))]
        await self.store.publish_live(stream.claim_event(token))

    # ---- model calls -----------------------------------------------------------------

    @domain_errors
    async def BeginModel(
        self, request: pb.BeginModelRequest, context: Context
    ) -> pb.BeginModelResponse:
        token = check_writer_token(request.token)
        check_position(request.position)
        entries = await self._writer.snapshot(token)
        decision = replay.decide_model(entries, attempt=token.attempt, position=request.position)
        match decision:
            case replay.UseResponse(response=response):
                return pb.BeginModelResponse(recorded=True, response=response)
            case replay.Mismatch(reason=reason):
                raise errors.ReplayMismatch(reason)
        await self._writer.check_tail(token)  # a fenced holder must not spend a model call
        if request.HasField("budget"):
            return await self._within_budget(token, request)
        return pb.BeginModelResponse(recorded=False)

    async def _within_budget(
        self, token: pb.WriterToken, request: pb.BeginModelRequest
    ) -> pb.BeginModelResponse:
        """Refuse a new model call once the run spent its budget (its raises
        added). Under the pause policy a call found over budget first places
        the step's queued budget inputs at its position, then decides again.

        Raises:
            BudgetExceeded: the run spent its budget.
        """
        budget = check_budget(request.budget)
        found = await self._ledgers.read(token.run_id)
        decision = ledger.decide_budget(found.spent(), budget.raised(found.raised()))
        answer = pb.BeginModelResponse(recorded=False)
        if isinstance(decision, ledger.OverBudget) and budget.policy is Policy.PAUSE:
            placed = await self._place_raises(token, request.position)
            if placed is not None:
                answer.token.CopyFrom(placed)
                found = await self._ledgers.read(token.run_id)
                decision = ledger.decide_budget(found.spent(), budget.raised(found.raised()))
        match decision:
            case ledger.WithinBudget():
                return answer
            case ledger.OverBudget(spent=spent, budget=limit, reason=reason):
                raise errors.BudgetExceeded(
                    token.run_id,
                    step_id=token.step_id,
                    tokens=spent.tokens,
                    cost_micros=spent.cost_micros,
                    budget_tokens=limit.tokens,
                    budget_cost_micros=limit.cost_micros,
                    detail=reason,
                )
            case _:
                assert_never(decision)

    async def _place_raises(self, token: pb.WriterToken, position: int) -> pb.WriterToken | None:
        """Place the step's queued budget inputs at ``position`` (exactly once,
        as any placement); the writer's next token when any was placed."""
        if self._placement is None:
            return None
        request = pb.PlaceInputsRequest(token=token, position=position, mode=ledger.BUDGET_MODE)
        placed = await self._placement.place(token, request)
        return placed.token if placed.inputs else None

    @domain_errors
    async def RecordSpent(
        self, request: pb.RecordSpentRequest, context: Context
    ) -> pb.RecordSpentResponse:
        """Store what a fenced holder's model call spent on the step's spent
        subject (the fence refuses its record on the step's own)."""
        token = check_writer_token(request.token)
        check_position(request.position)
        usage = priced(request.usage, self._prices, field="usage")
        record = pb.Record(
            run_id=token.run_id,
            step_id=token.step_id,
            iteration=token.iteration,
            attempt=token.attempt,
            writer=token.writer,
            model=pb.ModelCall(position=request.position, usage=usage),
        )
        record.time.GetCurrentTime()
        await self.store.append_spent(token, record)
        self.meter.count(token.run_id, usage)
        return pb.RecordSpentResponse()

    @domain_errors
    async def RecordModel(
        self, request: pb.RecordModelRequest, context: Context
    ) -> pb.RecordModelResponse:
        token = check_writer_token(request.token)
        usage = request.usage if request.HasField("usage") else None
        model = _model_call(
            request.position, request.response, field="", usage=usage, prices=self._prices
        )
        token, _ = await self._store_model(token, model)
        return pb.RecordModelResponse(token=token)

    async def _store_model(
        self, token: pb.WriterToken, model: pb.ModelCall, record: pb.Record | None = None
    ) -> tuple[pb.WriterToken, pb.Record]:
        """Append ``model``: on its own, or ahead of ``record``'s entry in one
        record; then end the call's live stream with the record's sequence."""
        if record is None:
            record = pb.Record(model=model)
        else:
            record.leading_model.CopyFrom(model)
        token, stored = await self._writer.append(token, record)
        await self.store.publish_live(stream.committed_event(token, stored))
        if model.HasField("usage"):
            self.meter.count(token.run_id, model.usage)
        return token, stored

    # ---- live preview ----------------------------------------------------------------

    async def PutStream(
        self, request_iterator: AsyncIterator[pb.PutStreamRequest], context: Context
    ) -> pb.PutStreamResponse:
        published = refused = 0
        try:
            async for request in request_iterator:
                token = check_writer_token(request.token)
                check_position(request.position)
                event = stream.chunk_event(request)
                holder = self._holders.get((token.run_id, token.step_id))
                if holder is not None and holder != token.writer:
                    refused += 1  # a fenced holder: never shown as current
                    continue
                await self.store.publish_live(event)
                published += 1
        except errors.DagnatsError as err:
            await abort_with(context, err)
        return pb.PutStreamResponse(published=published, refused=refused)

    async def WatchStream(
        self, request: pb.WatchStreamRequest, context: Context
    ) -> AsyncIterator[pb.WatchStreamResponse]:
        try:
            run_id = check_run_id(request.run_id)
            step_id = check_token(request.step_id, field="step_id")
        except errors.DagnatsError as err:
            await abort_with(context, err)
            return
        queue = stream.WatchQueue()
        # Never waits: a slow watcher gets a gap, never a stall.
        stop = await self.store.watch_live(run_id, step_id, queue.put)
        try:
            # The tail is read once the subscription is in place: a claim stored
            # before the read is in the tail, one stored after it is on the queue.
            try:
                rules = stream.StreamRules.after(await self.store.tail(run_id, step_id))
            except errors.DagnatsError as err:
                await abort_with(context, err)
                return
            yield pb.WatchStreamResponse()  # subscribed: nothing published from now is missed
            while True:
                for event in rules.apply(await queue.get()):
                    yield pb.WatchStreamResponse(id=event.id, data=event.json().encode())
        finally:
            await stop()

    # ---- tool calls ------------------------------------------------------------------

    @domain_errors
    async def BeginTool(
        self, request: pb.BeginToolRequest, context: Context
    ) -> pb.BeginToolResponse:
        token = check_writer_token(request.token)
        check_position(request.position)
        if not request.name or len(request.name) > 256:
            raise errors.InvalidArgument("name must be 1-256 characters", field="name")
        check_json(request.input, field="input", allow_empty=False)
        _check_approval(token, request)
        model = _leading_model(request, self._prices)
        call = jm.ToolCall(
            name=request.name,
            input=request.input,
            safe=request.replay == pb.REPLAY_SAFE,
            digest=request.digest,
            approval_id=request.approval.request_id if request.HasField("approval") else "",
        )
        entries = await self._writer.snapshot(token)
        decision = replay.decide_tool(
            entries,
            attempt=token.attempt,
            position=request.position,
            call=call,
            honoured=token.honoured,
            honoured_members=_honoured_members(token),
        )
        if isinstance(decision, replay.Mismatch):
            raise errors.ReplayMismatch(decision.reason)  # and nothing is written
        if model is not None and not isinstance(decision, replay.RunNew | replay.Honour):
            # The decision writes no intent the response could ride: it is stored
            # first, on its own, as RecordModel would have.
            token, _ = await self._store_model(token, model)
            model = None
        answer = await self._begin_tool(token, request, decision, model)
        answer.key = f"{token.run_id}.{token.step_id}.{token.iteration}.{request.position}"
        answer.intent_seq = answer.intent_seq or answer.result.intent_seq
        return answer

    async def _begin_tool(
        self,
        token: pb.WriterToken,
        request: pb.BeginToolRequest,
        decision: replay.ToolDecision,
        model: pb.ModelCall | None,
    ) -> pb.BeginToolResponse:
        """Write what ``decision`` says; ``model`` rides the intent it writes."""
        match decision:
            case replay.UseResult(result=result):
                return pb.BeginToolResponse(token=token, result=convert.result_to_proto(result))
            case replay.RunAgain(intent=intent):
                # Only a fenced append may start a side effect: an empty output
                # record proves this writer still holds the step.
                marker = pb.Record(tool_output=pb.ToolOutput(intent_seq=intent.seq))
                token, _ = await self._writer.append(token, marker)
                return pb.BeginToolResponse(token=token, run=True, intent_seq=intent.seq)
            case replay.Interrupt(intent=intent, partial=partial):
                cut = pb.ToolResult(intent_seq=intent.seq, interrupted=True, partial=partial)
                token, _ = await self._writer.append(token, pb.Record(tool_result=cut))
                return pb.BeginToolResponse(token=token, result=cut)
            case replay.Honour(earlier=earlier, result=result):
                return await self._honour(token, request, earlier, result, model)
            case replay.RunNew():
                token, intent_record = await self._append_intent(token, _intent(request), model)
                return pb.BeginToolResponse(token=token, run=True, intent_seq=intent_record.seq)
            case replay.Mismatch(reason=reason):
                raise errors.ReplayMismatch(reason)

    async def _honour(
        self,
        token: pb.WriterToken,
        request: pb.BeginToolRequest,
        earlier: jm.IntentEntry,
        earlier_result: jm.ResultEntry,
        model: pb.ModelCall | None,
    ) -> pb.BeginToolResponse:
        intent = _intent(request)
        intent.tool_intent.honours_seq = earlier.seq
        token, intent = await self._append_intent(token, intent, model)
        result = convert.result_to_proto(earlier_result)
        result.intent_seq = intent.seq
        token, _ = await self._writer.append(token, pb.Record(tool_result=result))
        token.honoured.append(earlier.seq)
        return pb.BeginToolResponse(token=token, result=result)

    async def _append_intent(
        self, token: pb.WriterToken, intent: pb.Record, model: pb.ModelCall | None
    ) -> tuple[pb.WriterToken, pb.Record]:
        if model is None:
            return await self._writer.append(token, intent)
        return await self._store_model(token, model, intent)

    @domain_errors
    async def BeginTools(
        self, request: pb.BeginToolsRequest, context: Context
    ) -> pb.BeginToolsResponse:
        token = check_writer_token(request.token)
        if not request.calls or len(request.calls) > MAX_GROUP_CALLS:
            raise errors.InvalidArgument(
                f"a parallel group has 1-{MAX_GROUP_CALLS} calls", field="calls"
            )
        check_position(request.position)
        check_position(request.position + len(request.calls) - 1)
        for i, call in enumerate(request.calls):
            if not call.name or len(call.name) > 256:
                raise errors.InvalidArgument(
                    "name must be 1-256 characters", field=f"calls[{i}].name"
                )
            check_json(call.input, field=f"calls[{i}].input", allow_empty=False)
            _check_approval(token, call, at=f"calls[{i}].")
        model = None
        if request.HasField("model"):
            if request.model.position != request.position - 1:
                raise errors.InvalidArgument(
                    f"model.position must be position - 1 ({request.position - 1})",
                    field="model.position",
                )
            model = _leading(request.model, self._prices)
        return await self._groups.begin(token, request, model)

    @domain_errors
    async def ToolOutput(
        self, request: pb.ToolOutputRequest, context: Context
    ) -> pb.ToolOutputResponse:
        token = check_writer_token(request.token)
        _check_intent_seq(token, request.intent_seq)
        output = pb.ToolOutput(
            intent_seq=request.intent_seq, chunk=request.chunk, intent_index=request.intent_index
        )
        token, _ = await self._writer.append(token, pb.Record(tool_output=output))
        return pb.ToolOutputResponse(token=token)

    @domain_errors
    async def FinishTool(
        self, request: pb.FinishToolRequest, context: Context
    ) -> pb.FinishToolResponse:
        token = check_writer_token(request.token)
        result = _tool_result(token, request, field="")
        token, _ = await self._writer.append(token, pb.Record(tool_result=result))
        return pb.FinishToolResponse(token=token)

    # ---- inputs ---------------------------------------------------------------------------

    @domain_errors
    async def PlaceInputs(
        self, request: pb.PlaceInputsRequest, context: Context
    ) -> pb.PlaceInputsResponse:
        token = check_writer_token(request.token)
        check_position(request.position)
        if request.mode not in MODES:
            raise errors.InvalidArgument(
                "mode must be 1 (steer), 2 (follow-up) or 50 (approval)", field="mode"
            )
        if self._placement is None:
            raise errors.Unavailable("this journal service has no inputs store")
        return await self._placement.place(token, request)

    # ---- holding and committing -------------------------------------------------------

    @domain_errors
    async def CheckTail(
        self, request: pb.CheckTailRequest, context: Context
    ) -> pb.CheckTailResponse:
        await self._writer.check_tail(check_writer_token(request.token))
        return pb.CheckTailResponse()

    @domain_errors
    async def Commit(self, request: pb.CommitRequest, context: Context) -> pb.CommitResponse:
        token = check_writer_token(request.token)
        commit = request.commit
        if commit.action == pb.ACTION_UNSPECIFIED:
            raise errors.InvalidArgument("commit.action is required", field="commit.action")
        if commit.output:
            check_json(commit.output, field="commit.output", allow_empty=False)
        if commit.has_state:
            _check_state(commit, self._state_max_bytes)
        if commit.action == pb.ACTION_PAUSE and commit.pause.ToNanoseconds() <= 0:
            raise errors.InvalidArgument("commit.pause must be positive", field="commit.pause")
        check_build_id(commit.build_id, field="commit.build_id")
        lease = check_lease(request.lease) if request.lease else ""
        record = pb.Record(commit=commit)
        match request.WhichOneof("leading"):
            case "model":
                model = _leading(request.model, self._prices)
                token, record = await self._store_model(token, model, record)
            case "tool_result":
                result = _tool_result(token, request.tool_result, field="tool_result.")
                record.leading_tool_result.CopyFrom(result)
                token, record = await self._writer.append(token, record)
            case _:
                token, record = await self._writer.append(token, record)
        self._writer.forget(token)
        answer = pb.CommitResponse(commit_seq=record.seq, record=record)
        if lease and request.keep_task and _keepable(commit):
            # The task message carries on to the next iteration if the engine
            # dispatches it at once: answer once it decided (ADR 31), with the
            # dispatch's claim handed over (ADR 34).
            nxt = await self._settle_kept(lease, record)
            if nxt is not None:
                nxt.token.CopyFrom(await self._hand_over(token, record, nxt))
                answer.next.CopyFrom(nxt)
            answer.settled = True
        elif lease:
            # The stored commit is the step's progress: answer now, and settle
            # the task behind the answer (ADR 9).
            self._behind_answer(self._settle(lease, record))
            answer.settled = True
        return answer

    async def _settle_kept(self, lease: str, record: pb.Record) -> pb.NextDispatch | None:
        """Settle the task of a stored continue keeping its message for the
        next iteration; the dispatch the message carries on to, or None."""
        try:
            await seam("after_commit_stored")
            task = await self._tasks.keep(lease, record, wait=EVENT_WAIT)
            await seam("after_kept_decision")
        except Exception as err:
            # A kept dispatch written meanwhile leases the message when it is back.
            await self._unsettled(lease, record, err)
            return None
        if task is None:
            return None
        return pb.NextDispatch(
            iteration=task.iteration,
            attempt=task.attempt,
            input=task.input,
            trace_context=dict(task.trace_context),
        )

    async def _hand_over(
        self, token: pb.WriterToken, commit: pb.Record, nxt: pb.NextDispatch
    ) -> pb.WriterToken:
        """The token of the dispatch ``nxt`` that the kept task message carries
        on to after ``commit``, for the same holder (the same delivery): a new
        writer, fenced on the commit, whose first record stores the claim
        (ADR 34). Nothing of ``nxt``'s iteration can be stored yet: the engine
        dispatched it after this commit, and any claim of it would follow the
        commit, so the replay snapshot is empty."""
        handed = _new_writer(
            token.run_id,
            token.step_id,
            (nxt.iteration, nxt.attempt),
            after=commit.seq,
            base=replay.base_before(convert.entry(commit), nxt.iteration),
            delivery=token.delivery,
        )
        handed.snapshot_seq = commit.seq
        handed.claim.delivery = token.delivery
        handed.build_id = token.build_id  # the same holder, of the same build
        self._writer.remember(handed, [])
        await self._now_holding(handed)
        return handed

    def _behind_answer(self, settle: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(settle)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle_claimed(self, lease: str, settled: pb.Settled) -> None:
        """Settle a task whose claim answered ``settled``: a stale one is only
        released; a stored commit (committed before a crash, or the restart
        limit's failure) has its event published under its own dispatch."""
        if settled.reason != "stale":
            await self._settle(lease, settled.commit)
            return
        try:
            await self._tasks.release(lease)
        except Exception as err:  # the task comes back, and its claim answers stale again
            log.warning("could not acknowledge a stale task: %s", err)

    async def _settle(self, lease: str, record: pb.Record) -> None:
        """Publish the event of a stored commit and acknowledge its task, as Report
        would. If that fails, the task comes back, and its next claim finds the
        commit and republishes the event; a negative acknowledgement brings it
        back at once rather than when its lease runs out."""
        try:
            await seam("after_commit_stored")
            await self._tasks.settle(lease, record, wait=EVENT_WAIT)
        except Exception as err:
            await self._unsettled(lease, record, err)

    async def _unsettled(self, lease: str, record: pb.Record, err: Exception) -> None:
        """A stored commit whose event may not be published: its task comes
        back at once, and its next claim republishes the event."""
        log.warning(
            "%s/%s: commit at seq %d is stored but its event was not published (%s); "
            "the task comes back and its next claim republishes it",
            record.run_id,
            record.step_id,
            record.seq,
            err,
        )
        with contextlib.suppress(Exception):
            await self._tasks.redeliver(lease)

    async def close(self) -> None:
        """Wait up to ``SETTLE_GRACE`` seconds for the settles of answered commits;
        a task whose settle is cut short comes back when its lease runs out."""
        if self._settling:
            await asyncio.wait(set(self._settling), timeout=SETTLE_GRACE)

    # ---- one dispatch over one stream --------------------------------------------------

    async def Session(
        self, request_iterator: AsyncIterator[pb.SessionRequest], context: Context
    ) -> AsyncIterator[pb.SessionResponse]:
        # An async generator, not a function returning one: grpc.aio runs any
        # other stream handler in a thread.
        async for response in session.serve(self, SESSION_CALLS, request_iterator, context):
            yield response

    # ---- reading -----------------------------------------------------------------------

    async def Read(
        self, request: pb.ReadRequest, context: Context
    ) -> AsyncIterator[pb.ReadResponse]:
        try:
            run_id = check_run_id(request.run_id)
            step_id = check_token(request.step_id, field="step_id")
            await self._run(run_id)
        except errors.DagnatsError as err:
            await abort_with(context, err)
            return
        if request.follow:
            async for record in self.store.follow(run_id, step_id, from_seq=request.from_seq):
                yield pb.ReadResponse(record=record)
            return
        limit = min(request.limit or 500, MAX_PAGE)
        after = max(request.from_seq, 1) - 1
        for record in await self.store.read(run_id, step_id, after=after, limit=limit):
            yield pb.ReadResponse(record=record)

    async def ReadState(
        self, request: pb.ReadStateRequest, context: Context
    ) -> AsyncIterator[pb.ReadStateResponse]:
        try:
            run_id = check_run_id(request.run_id)
            step_id = check_token(request.step_id, field="step_id")
            await self._run(run_id)
            commit = await self._commit_at(run_id, step_id, request.at_seq)
            found = await state.state_at(self.store, commit)
        except errors.DagnatsError as err:
            await abort_with(context, err)
            return
        if found is None:
            yield pb.ReadStateResponse(commit_seq=commit.seq, has_state=False)
            return
        for answer in state.chunks(found, commit.seq):
            yield answer

    async def _commit_at(self, run_id: str, step_id: str, at_seq: int) -> pb.Record:
        """The commit of ``run_id``'s step ``step_id`` at ``at_seq``; 0: its
        last commit that ended an iteration."""
        if at_seq:
            record = await self.store.get(at_seq)
            if (
                record is None
                or (record.run_id, record.step_id) != (run_id, step_id)
                or not record.HasField("commit")
            ):
                raise errors.NotFound(
                    f"no commit of step {step_id!r} at sequence {at_seq}", field="at_seq"
                )
            return record
        tail = await self.store.tail(run_id, step_id)
        base = 0 if tail is None else (tail.seq if _ends_iteration(tail) else tail.base_seq)
        record = await self.store.get(base) if base else None
        if record is None:
            raise errors.NotFound(f"step {step_id!r} has no commit yet", field="step_id")
        return record

    @domain_errors
    async def Check(self, request: pb.CheckRequest, context: Context) -> pb.CheckResponse:
        run_id = check_run_id(request.run_id)
        # A running loop moves on while it is audited: the run now, read
        # before the journals and again after them, brackets their count.
        run = await self._run(run_id)
        steps: dict[str, list[jm.AnyEntry]] = {}
        forks: dict[str, audit.ForkDigests] = {}
        stored = 0
        for step in run.steps:
            records = await self.store.read(run_id, step.step_id, after=0)
            if records:
                steps[step.step_id] = convert.all_entries(records)
                stored += len(records)
                if (digests := await self._fork_digests(records)) is not None:
                    forks[step.step_id] = digests
        after = await self._run(run_id) if run.status == epb.RUN_STATUS_RUNNING else run
        iterations = {s.step_id: s.iterations for s in run.steps if s.step_id in steps}
        iterations_after = {s.step_id: s.iterations for s in after.steps if s.step_id in steps}
        settling = {s.step_id for r in (run, after) for s in r.steps if s.status in _SETTLING}
        engine_steps = {
            s.step_id: audit.EngineStep(
                status=epb.StepStatus.Name(s.status).removeprefix("STEP_STATUS_").lower(),
                iteration=s.iteration,
                output=s.output,
            )
            for s in run.steps
            if s.step_id in steps
        }
        findings = audit.check_run(
            steps, iterations, settling, engine_steps, iterations_after, forks
        )
        return pb.CheckResponse(
            violations=[
                pb.Violation(step_id=f.step_id, seq=f.seq, rule=f.rule, message=f.message)
                for f in findings
            ],
            steps=len(steps),
            records=stored,
        )

    async def _fork_digests(self, records: list[pb.Record]) -> audit.ForkDigests | None:
        """The digests of a forked step's copied prefix: as this journal
        holds it, and as its source holds it while the source run exists."""
        # The last fork record is this journal's own (a fork of a fork copies
        # its source's with the prefix).
        at = next((i for i in reversed(range(len(records))) if records[i].HasField("fork")), None)
        if at is None:
            return None
        fork = records[at].fork
        source: str | None = None
        if await self._runs.get_run(fork.run_id) is not None:
            through = await self.store.read(fork.run_id, fork.step_id, after=0, through=fork.at_seq)
            source = prefix_digest(through)
        return audit.ForkDigests(copied=prefix_digest(records[:at]), source=source)

    # ---- helpers -------------------------------------------------------------------------

    async def _run(self, run_id: str) -> epb.Run:
        run = await self._runs.get_run(run_id)
        if run is None:
            raise errors.NotFound(f"run {run_id} does not exist", field="run_id")
        return run


def _new_writer(
    run_id: str, step_id: str, dispatch: tuple[int, int], *, after: int, base: int, delivery: int
) -> pb.WriterToken:
    """The token of a new writer of ``dispatch`` (iteration, attempt), with a
    nonce of its own, appending after the sequence ``after``."""
    return pb.WriterToken(
        run_id=run_id,
        step_id=step_id,
        iteration=dispatch[0],
        attempt=dispatch[1],
        writer=secrets.token_hex(8),
        last_seq=after,
        base_seq=base,
        delivery=delivery,
    )


def _claimant(request: pb.ClaimRequest, tail: pb.Record | None, base: int) -> pb.WriterToken:
    """The token of the writer a claim makes, appending after ``tail``: its
    records carry the claimant's build."""
    token = _new_writer(
        request.run_id,
        request.step_id,
        (request.iteration, request.attempt),
        after=tail.seq if tail else 0,
        base=base,
        delivery=max(request.delivery, 0),
    )
    token.build_id = request.build_id
    return token


def _asked(
    request: pb.ClaimRequest, limit: int, *, with_lease: bool, first_dispatch: bool = False
) -> replay.ClaimAsked:
    """The claim ``request`` asks, for ``replay.claim_step``; the claim with
    the lease may always ride."""
    return replay.ClaimAsked(
        iteration=request.iteration,
        attempt=request.attempt,
        delivery=request.delivery,
        worker_id=request.worker_id,
        limit=limit,
        may_ride=with_lease or request.may_ride,
        with_lease=with_lease,
        first_dispatch=first_dispatch,
    )


def _entries(tail: pb.Record | None) -> tuple[jm.AnyEntry, ...]:
    """The entries of a tail record; none for an empty journal."""
    return tuple(convert.entries(tail)) if tail is not None else ()


SESSION_CALLS = session.behaviours(JournalServicer)


def _ends_iteration(record: pb.Record) -> bool:
    entry = convert.entry(record)
    return isinstance(entry, jm.CommitEntry) and entry.ends_iteration


def _keepable(commit: pb.Commit) -> bool:
    """Whether a commit may keep its task for the next iteration: a continue
    that does not wait (a wait frees the worker)."""
    return (
        commit.action == pb.ACTION_CONTINUE
        and not commit.wait_until_input
        and not commit.HasField("wait_delay")
        and not commit.HasField("wait_until")
    )


def _intent(request: pb.BeginToolRequest) -> pb.Record:
    intent = pb.ToolIntent(
        position=request.position,
        name=request.name,
        input=request.input,
        replay=request.replay or pb.REPLAY_UNSAFE,
        digest=request.digest,
    )
    if request.HasField("approval"):
        intent.approval.CopyFrom(request.approval)
    return pb.Record(tool_intent=intent)


def _check_approval(
    token: pb.WriterToken, request: pb.BeginToolRequest | pb.ToolCallSpec, *, at: str = ""
) -> None:
    """Refuse a tool call whose approval fields do not bind its arguments: a
    digest other than its name's and input's, an approval without a digest,
    or an approval of another step's call or of a digest the call does not
    have (unless the approver edited the arguments). ``at`` prefixes the
    fields named in errors (a parallel group's call)."""
    if request.digest and request.digest != call_digest(request.name, request.input):
        raise errors.InvalidArgument(
            f"digest {request.digest} is not the digest of tool {request.name!r} with this input",
            field=at + "digest",
        )
    if not request.HasField("approval"):
        return
    approval = request.approval
    if not request.digest:
        raise errors.InvalidArgument("an approved call needs its digest", field=at + "digest")
    if not approval.call.startswith(f"{token.run_id}.{token.step_id}."):
        raise errors.InvalidArgument(
            f"approval.call {approval.call!r} is not a call of this step",
            field=at + "approval.call",
        )
    if not is_digest(approval.digest):
        raise errors.InvalidArgument(
            "approval.digest is not a digest", field=at + "approval.digest"
        )
    if not approval.edited and approval.digest != request.digest:
        raise errors.InvalidArgument(
            f"the approval is for digest {approval.digest}, not this call's {request.digest}",
            field=at + "approval.digest",
        )


def _leading_model(request: pb.BeginToolRequest, prices: Prices) -> pb.ModelCall | None:
    """The model response a tool call's intent is to be stored with, checked."""
    if not request.HasField("model"):
        return None
    if request.model.position != request.position - 1:
        raise errors.InvalidArgument(
            f"model.position must be position - 1 ({request.position - 1}): the response "
            "an intent is stored with is the call's just before it",
            field="model.position",
        )
    return _leading(request.model, prices)


def _leading(model: pb.ModelCall, prices: Prices) -> pb.ModelCall:
    """A leading model response to store, checked and priced."""
    usage = model.usage if model.HasField("usage") else None
    return _model_call(model.position, model.response, field="model.", usage=usage, prices=prices)


def _model_call(
    position: int,
    response: bytes,
    *,
    field: str,
    usage: pb.Usage | None = None,
    prices: Prices | None = None,
) -> pb.ModelCall:
    """A model response to store; ``field`` prefixes the names in errors."""
    check_position(position)
    check_json(response, field=field + "response", allow_empty=False)
    model = pb.ModelCall(position=position, response=response)
    if usage is not None:
        model.usage.CopyFrom(priced(usage, prices or {}, field=field + "usage"))
    return model


def priced(usage: pb.Usage, prices: Prices, *, field: str) -> pb.Usage:
    """A call's usage, checked, with its cost from the price table when the
    table names its model (the table's price wins over a cost sent with it).

    Raises:
        InvalidArgument: a negative count, more cached tokens than input
            tokens, a model name over 256 characters, a negative cost.
    """
    counts = {
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "cached_tokens": usage.cached_tokens,
        "cost_micros": usage.cost_micros,
    }
    for name, value in counts.items():
        if value < 0:
            raise errors.InvalidArgument(f"{field}.{name} must be >= 0", field=f"{field}.{name}")
    if usage.cached_tokens > usage.input_tokens:
        raise errors.InvalidArgument(
            f"{field}.cached_tokens counts input tokens: at most input_tokens",
            field=f"{field}.cached_tokens",
        )
    if len(usage.model) > 256:
        raise errors.InvalidArgument(
            f"{field}.model is over 256 characters", field=f"{field}.model"
        )
    out = pb.Usage()
    out.CopyFrom(usage)
    cost = price(convert.usage_of(pb.ModelCall(usage=usage)) or Usage(), prices)
    if cost is not None:
        out.cost_micros, out.priced = cost, True
    return out


def _tool_result(
    token: pb.WriterToken, request: pb.FinishToolRequest | pb.ToolResult, *, field: str
) -> pb.ToolResult:
    """The result to store for a finished call (FinishTool's, or one that rides
    a commit); ``field`` prefixes the names in errors."""
    _check_intent_seq(token, request.intent_seq, field + "intent_seq")
    if request.awaiting_approval:
        return pb.ToolResult(
            intent_seq=request.intent_seq,
            intent_index=request.intent_index,
            awaiting_approval=True,
        )
    if request.interrupted:
        partial = replay.cut_partial(request.partial)
        return pb.ToolResult(
            intent_seq=request.intent_seq,
            intent_index=request.intent_index,
            interrupted=True,
            partial=partial,
        )
    if not request.error:
        check_json(request.output, field=field + "output", allow_empty=False)
    return pb.ToolResult(
        intent_seq=request.intent_seq,
        intent_index=request.intent_index,
        output=request.output,
        error=request.error,
    )


def _honoured_members(token: pb.WriterToken) -> list[tuple[int, int]]:
    return [(m.seq, m.index) for m in token.honoured_members]


def _check_state(commit: pb.Commit, limit: int) -> None:
    """A commit's state, whole (JSON) or a delta (the state chain), checked at
    the edge: a delta's size is what it keeps and adds, and no state is past
    ``limit``."""
    if not commit.HasField("state_delta"):
        check_json(commit.state, field="commit.state", allow_empty=False)
        size = len(commit.state)
    else:
        delta = commit.state_delta
        if commit.state:
            raise errors.InvalidArgument(
                "a commit carries its state whole or as a delta, not both", field="commit.state"
            )
        if delta.size != delta.keep + len(delta.tail) or delta.depth < 1:
            raise errors.InvalidArgument(
                f"commit.state_delta makes {delta.keep + len(delta.tail):,} bytes, says "
                f"{delta.size:,}, at depth {delta.depth} (at least 1)",
                field="commit.state_delta",
            )
        size = delta.size
    if size > limit:
        raise errors.StateTooLarge(
            statechain.StateOverLimit(size, limit).message(), field="commit.state"
        )


def _page(claimed: pb.Claimed, records: list[pb.Record]) -> None:
    """Put the iteration's records into ``claimed`` while the answer fits
    ``MAX_ANSWER_BYTES``; ``more_from_seq`` names the first one left out."""
    size = claimed.ByteSize()
    for record in records:
        size += record.ByteSize() + 8  # the field's tag and length
        if size > MAX_ANSWER_BYTES:
            claimed.more_from_seq = record.seq
            return
        claimed.records.append(record)


def _settled(reason: str, *, commit: pb.Record | None = None, detail: str = "") -> pb.ClaimResponse:
    return pb.ClaimResponse(settled=pb.Settled(reason=reason, commit=commit, detail=detail))
