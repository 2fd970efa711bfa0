"""PlaceInputs: the step's queued inputs, claimed in the inputs bucket and
recorded in the journal, exactly once across crashes, retries and successors.

An input is claimed with compare-and-swap, then recorded as ``input.placed``.
The replay rules decide whether a call places anything new; a claim left
without its record by a holder of this iteration (fenced, crashed, or this
writer's own earlier try whose answer was lost) is taken over, and what an
earlier try recorded is part of the answer.
"""

from __future__ import annotations

import asyncio
import logging

from dagnats.core import errors
from dagnats.core.seam import seam
from dagnats.core.subjects import journal_subject
from dagnats.inputs import rules as input_rules
from dagnats.inputs.store import InputStore, change
from dagnats.journal import convert, replay
from dagnats.journal import model as jm
from dagnats.journal.limits import MAX_PLACED_BYTES
from dagnats.journal.v1 import journal_pb2 as pb
from dagnats.journal.writer import JournalWriter, fenced

MODES = {1: "STEER", 2: "FOLLOW_UP", 50: "APPROVAL", 100: "BUDGET"}

log = logging.getLogger("dagnats.journal")


class InputPlacement:
    def __init__(self, writer: JournalWriter, inputs: InputStore) -> None:
        self._writer = writer
        self._inputs = inputs

    async def place(
        self, token: pb.WriterToken, request: pb.PlaceInputsRequest
    ) -> pb.PlaceInputsResponse:
        """Place the inputs of ``request.mode`` for a writer; the request is valid.

        A writer found fenced gives back what it claimed and never recorded.
        Once begun, a placement runs to its end even when its caller goes
        away (its deadline, its lease): cancelled between a claim and its
        record, it would leave the claim with neither record nor give-back.
        """
        work = asyncio.ensure_future(self._place_or_give_back(token, request))
        work.add_done_callback(_retrieve)
        return await asyncio.shield(work)

    async def _place_or_give_back(
        self, token: pb.WriterToken, request: pb.PlaceInputsRequest
    ) -> pb.PlaceInputsResponse:
        try:
            return await self._place(token, request)
        except errors.Fenced:
            await self._release_unrecorded(token)
            raise

    async def _place(
        self, token: pb.WriterToken, request: pb.PlaceInputsRequest
    ) -> pb.PlaceInputsResponse:
        snapshot = await self._writer.snapshot(token)
        token, earlier, retried = await self._own_records(token, request.position)
        await seam("before_inputs_listed")
        entries = [*snapshot, *earlier]
        decision = replay.decide_place(
            entries, attempt=token.attempt, position=request.position, mode=request.mode
        )
        # What an earlier try of this very call recorded before its answer was
        # lost is part of this answer; the rest of the plan goes on after it.
        placed = [r.input_placed for r in retried if r.HasField("input_placed")]
        done = frozenset(p.request_id for p in placed)
        recorded = done | {e.request_id for e in entries if isinstance(e, jm.InputEntry)}
        match decision:
            case replay.Mismatch(reason=reason):
                raise errors.ReplayMismatch(reason)
            case replay.ReplayPlaced(inputs=replayed):
                placed[:0] = [convert.placed_to_proto(e) for e in replayed]
                token = await self._claim_queued(token, request, recorded, placed, queued=False)
            case replay.PlaceNew(carry=carry):
                for earlier_input in carry:
                    if earlier_input.request_id in done:
                        continue
                    copy = convert.placed_to_proto(earlier_input)
                    copy.position, copy.carried = request.position, True
                    token, record = await self._writer.append(token, pb.Record(input_placed=copy))
                    placed.append(record.input_placed)
                token = await self._claim_queued(token, request, recorded, placed, queued=True)
        return pb.PlaceInputsResponse(token=token, inputs=placed)

    async def _release_unrecorded(self, token: pb.WriterToken) -> None:
        """Put back in the queue each input this fenced writer claimed in the
        bucket but never recorded: checked current, its call was slow (an
        election inside it) while a successor claimed and placed the step's
        inputs, then it claimed one that arrived meanwhile. Best effort: a
        failure here is logged, and the input stays as it was."""
        try:
            records = await self._writer.store.read(
                token.run_id, token.step_id, after=token.base_seq
            )
            recorded = {r.input_placed.request_id for r in records if r.HasField("input_placed")}
            now = self._writer.clock()

            def give_back(state: input_rules.InputState) -> input_rules.InputState | None:
                return input_rules.release(
                    state,
                    iteration=token.iteration,
                    writer=token.writer,
                    recorded=recorded,
                    now=now,
                )

            for state, revision in await self._inputs.list(token.run_id, token.step_id):
                await change(self._inputs, state, revision, give_back)
        except errors.DagnatsError as err:
            log.warning(
                "journal.%s.%s: inputs claimed by fenced writer %s not given back: %s",
                token.run_id,
                token.step_id,
                token.writer,
                err,
            )

    async def _own_records(
        self, token: pb.WriterToken, position: int
    ) -> tuple[pb.WriterToken, list[jm.AnyEntry], list[pb.Record]]:
        """This writer's records since its claim: those its token knows (earlier
        calls of this dispatch), and those after its ``last_seq``, which an
        earlier try of this very call (at ``position``) wrote before its answer
        was lost. The token returned goes on after those, so no new record
        reuses their Msg-Ids, and carries no claim: the first of them stored it.

        Raises:
            Fenced: another writer's record follows the claim, or this writer
                went on past the call (``replay.placed_by_earlier_try``).
        """
        after = token.snapshot_seq or token.last_seq
        records = await self._writer.store.read(token.run_id, token.step_id, after=after)
        for record in records:
            if record.writer != token.writer:
                raise fenced(token, record.seq)
        known = convert.all_entries(r for r in records if r.seq <= token.last_seq)
        retried = [r for r in records if r.seq > token.last_seq]
        if not replay.placed_by_earlier_try([convert.entry(r) for r in retried], position=position):
            raise _went_on(token, retried)
        if retried:
            moved = pb.WriterToken()
            moved.CopyFrom(token)
            moved.last_seq = retried[-1].seq
            moved.written = token.written + len(retried)
            moved.ClearField("claim")
            token = moved
        return token, known, retried

    async def _claim_queued(
        self,
        token: pb.WriterToken,
        request: pb.PlaceInputsRequest,
        recorded: frozenset[str],
        placed: list[pb.InputPlaced],
        *,
        queued: bool,
    ) -> pb.WriterToken:
        """Claim each queued input (compare-and-swap), then record it. A claim
        left without its record by a holder of this iteration that was fenced
        or crashed in between -- this writer's own earlier try included -- is
        taken over. ``recorded`` names every input with a record in this
        iteration; with ``queued`` False only such left claims are taken."""
        now = self._writer.clock()
        mode = input_rules.Mode[MODES[request.mode]]
        iteration, attempt, writer = token.iteration, token.attempt, token.writer
        window = self._inputs.dedupe_window

        def claim(current: input_rules.InputState) -> input_rules.InputState | None:
            if not queued and current.status is input_rules.Status.QUEUED:
                return None  # a replayed call places nothing new
            return input_rules.claim_for(
                current,
                mode=mode,
                iteration=iteration,
                attempt=attempt,
                writer=writer,
                recorded=recorded,
                now=now,
                window=window,
            )

        for state, revision in await self._inputs.list(token.run_id, token.step_id):
            if state.status is input_rules.Status.QUEUED and _full(placed, state):
                continue  # placed by a later call: this answer must fit
            # An input changed since the listing is decided again as it is now:
            # withdrawn meanwhile, it is not ours; claimed by our own update
            # whose answer was lost, it is ours to record.
            claimed, changed = await change(self._inputs, state, revision, claim)
            if not changed or claimed is None or claimed.status is not input_rules.Status.PLACED:
                continue  # not ours, or expired (queued past the dedupe window)
            await seam("after_input_claimed")
            record = pb.InputPlaced(
                position=request.position,
                request_id=state.request_id,
                mode=request.mode,
                content=state.content,
            )
            token, stored = await self._writer.append(token, pb.Record(input_placed=record))
            placed.append(stored.input_placed)
        return token


def _went_on(token: pb.WriterToken, records: list[pb.Record]) -> errors.Fenced:
    """The error of a late copy of a placement: its writer's ``records`` after
    its token show the writer went on past the call (its commit, a later
    call), so the token it came with is behind."""
    last = records[-1]
    return errors.Fenced(
        token.run_id,
        token.step_id,
        expected=token.last_seq,
        actual=last.seq,
        detail=f"{journal_subject(token.run_id, token.step_id)}: this writer went on past "
        f"this placement after sequence {token.last_seq} (its {last.WhichOneof('kind')} "
        f"at {last.seq}); the token the call came with is behind",
    )


def _full(placed: list[pb.InputPlaced], state: input_rules.InputState) -> bool:
    """Whether placing ``state`` too would take the answer past its size."""
    size = sum(p.ByteSize() for p in placed) + len(state.content)
    return bool(placed) and size > MAX_PLACED_BYTES


def _retrieve(work: asyncio.Future[pb.PlaceInputsResponse]) -> None:
    """Take the outcome of a placement whose caller went away, so its error
    is logged as what it is instead of as a task nobody awaited."""
    if work.cancelled():
        return
    err = work.exception()
    if err is not None and not isinstance(err, errors.DagnatsError):
        log.warning("a placement ended with %r", err)
