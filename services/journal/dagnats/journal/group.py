"""BeginTools: the calls of a parallel group, decided and begun at once.

A parallel group is the tool calls of one model response, at consecutive
positions in the response's order. The replay rules decide each call
(``replay.decide_tools``); this module writes what they say, all before it
answers, so every intent of the group is stored before any call starts:

- the new intents (calls run for the first time, and calls honouring an
  earlier attempt's unsafe intent) in one record, the model response that
  asked for them ahead of them; in several records back to back when one
  record cannot hold them all;
- then the results the rules give at once: an ``interrupted`` result for an
  unsafe call whose intent has none, a copy of the honoured result;
- a call run again (safe, its intent recorded without a result) needs a fenced
  append before it starts: the group's other writes are that append, or else
  an empty output record for it.

An intent's identity is its record's sequence and its index in the record
(``IntentRef``); results and output name both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from dagnats.core import errors
from dagnats.journal import convert, replay
from dagnats.journal import model as jm
from dagnats.journal.limits import MAX_RECORD_BYTES
from dagnats.journal.v1 import journal_pb2 as pb
from dagnats.journal.writer import JournalWriter

# Room kept in a group's intent record for everything but the intents (the
# record's own fields, its leading model response is counted apart).
_RECORD_ROOM = 16 * 1024

StoreModel = Callable[
    [pb.WriterToken, pb.ModelCall, pb.Record | None], Awaitable[tuple[pb.WriterToken, pb.Record]]
]

Decided = replay.UseResult | replay.RunAgain | replay.Interrupt | replay.Honour | replay.RunNew


class ParallelGroups:
    """Writes what the replay rules decide for a parallel group."""

    def __init__(self, writer: JournalWriter, store_model: StoreModel) -> None:
        self._writer = writer
        self._store_model = store_model

    async def begin(
        self, token: pb.WriterToken, request: pb.BeginToolsRequest, model: pb.ModelCall | None
    ) -> pb.BeginToolsResponse:
        """Decide and begin the group of ``request`` (checked) for a writer."""
        calls = [
            jm.ToolCall(
                name=c.name,
                input=c.input,
                safe=c.replay == pb.REPLAY_SAFE,
                digest=c.digest,
                approval_id=c.approval.request_id if c.HasField("approval") else "",
            )
            for c in request.calls
        ]
        entries = await self._writer.snapshot(token)
        decision = replay.decide_tools(
            entries,
            attempt=token.attempt,
            position=request.position,
            calls=calls,
            honoured=token.honoured,
            honoured_members=[(m.seq, m.index) for m in token.honoured_members],
        )
        match decision:
            case replay.Mismatch(reason=reason):
                raise errors.ReplayMismatch(reason)  # and nothing is written
            case replay.Group(calls=decided):
                return await self._write(token, request, decided, model)

    async def _write(
        self,
        token: pb.WriterToken,
        request: pb.BeginToolsRequest,
        decided: Sequence[Decided],
        model: pb.ModelCall | None,
    ) -> pb.BeginToolsResponse:
        answers = [pb.BeginToolResponse() for _ in decided]
        written = token.written
        token, refs = await self._store_intents(token, request, decided, model)
        for i, decision in enumerate(decided):
            answer = answers[i]
            match decision:
                case replay.UseResult(result=result):
                    answer.result.CopyFrom(convert.result_to_proto(result))
                case replay.RunAgain(intent=intent):
                    answer.run = True
                    answer.intent_seq, answer.intent_index = intent.ref
                case replay.Interrupt(intent=intent, partial=partial):
                    cut = pb.ToolResult(
                        intent_seq=intent.seq,
                        intent_index=intent.index,
                        interrupted=True,
                        partial=partial,
                    )
                    token, _ = await self._writer.append(token, pb.Record(tool_result=cut))
                    answer.result.CopyFrom(cut)
                case replay.Honour(earlier=earlier, result=result):
                    copy = convert.result_to_proto(result)
                    copy.intent_seq, copy.intent_index = refs[i]
                    token, _ = await self._writer.append(token, pb.Record(tool_result=copy))
                    token.honoured_members.append(
                        pb.IntentRef(seq=earlier.seq, index=earlier.index)
                    )
                    answer.result.CopyFrom(copy)
                case replay.RunNew():
                    answer.run = True
                    answer.intent_seq, answer.intent_index = refs[i]
        again = [d for d in decided if isinstance(d, replay.RunAgain)]
        if again and token.written == written:
            # Only a fenced append may start a side effect: an empty output
            # record proves this writer still holds the step.
            seq, index = again[0].intent.ref
            marker = pb.Record(tool_output=pb.ToolOutput(intent_seq=seq, intent_index=index))
            token, _ = await self._writer.append(token, marker)
        for i, answer in enumerate(answers):
            answer.key = f"{token.run_id}.{token.step_id}.{token.iteration}.{request.position + i}"
            answer.intent_seq = answer.intent_seq or answer.result.intent_seq
            answer.intent_index = answer.intent_index or answer.result.intent_index
        return pb.BeginToolsResponse(token=token, calls=answers)

    async def _store_intents(
        self,
        token: pb.WriterToken,
        request: pb.BeginToolsRequest,
        decided: Sequence[Decided],
        model: pb.ModelCall | None,
    ) -> tuple[pb.WriterToken, dict[int, tuple[int, int]]]:
        """Store the intents the group writes, in as few records as the limit
        allows, ``model`` ahead of the first; the identity of each, by call."""
        new: list[tuple[int, pb.ToolIntent]] = []
        for i, decision in enumerate(decided):
            if isinstance(decision, replay.RunNew | replay.Honour):
                spec = request.calls[i]
                intent = pb.ToolIntent(
                    position=request.position + i,
                    name=spec.name,
                    input=spec.input,
                    replay=spec.replay or pb.REPLAY_UNSAFE,
                    digest=spec.digest,
                )
                if spec.HasField("approval"):
                    intent.approval.CopyFrom(spec.approval)
                if isinstance(decision, replay.Honour):
                    intent.honours_seq, intent.honours_index = decision.earlier.ref
                new.append((i, intent))
        refs: dict[int, tuple[int, int]] = {}
        if not new:
            if model is not None:
                token, _ = await self._store_model(token, model, None)
            return token, refs
        size = len(request.calls)
        for chunk in _chunks(new, first_room=model.ByteSize() if model is not None else 0):
            record = pb.Record(
                tool_intents=pb.ToolIntents(
                    intents=[intent for _, intent in chunk],
                    group_size=size,
                    group_position=request.position,
                )
            )
            if model is not None:
                token, stored = await self._store_model(token, model, record)
                model = None
            else:
                token, stored = await self._writer.append(token, record)
            for index, (i, _) in enumerate(chunk):
                refs[i] = (stored.seq, index)
        return token, refs


def _chunks(
    intents: list[tuple[int, pb.ToolIntent]], *, first_room: int
) -> list[list[tuple[int, pb.ToolIntent]]]:
    """``intents`` cut into runs that each fit a record (the first also holds
    ``first_room`` bytes of model response); an intent too large for a record
    alone gets one, which the store refuses as it would a single call's."""
    budget = MAX_RECORD_BYTES - _RECORD_ROOM
    chunks: list[list[tuple[int, pb.ToolIntent]]] = [[]]
    used = first_room
    for item in intents:
        size = item[1].ByteSize() + 8  # the field's tag and length
        if chunks[-1] and used + size > budget:
            chunks.append([])
            used = 0
        chunks[-1].append(item)
        used += size
    return chunks
