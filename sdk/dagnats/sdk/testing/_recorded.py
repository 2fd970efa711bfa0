"""A recorded dispatch's journal, answering a journal handle's calls.

The journal handle (``dagnats.sdk._journal.Journal``) sends each call to a
session (``dagnats.sdk._session.Session``: one call by its gRPC method's name
at a time); in production the session reaches the journal service, whose
replay rules (``dagnats.journal.replay``) decide each call on the records of
its iteration. Here the session is :class:`RecordedSession`: the same rules
decide each call on the records one dispatch stored, in memory, with no
service, and the answers are the ones the journal service gives from records
alone:

- a model call where a response is recorded: the response (``UseResponse``);
- a tool call, or a parallel group, whose results are recorded: the results
  (``UseResult``);
- a place-inputs call: the inputs recorded there (``ReplayPlaced``); none
  where the recording placed none and carried none;
- the tail check: the holder still holds the step;
- the commit: compared with the recorded commit.

Anything the service would write or run for instead is a divergence, recorded
in :attr:`RecordedSession.divergences`: another call at a recorded position
(``Mismatch``), a call the dispatch did not record (``CallModel``,
``RunNew``, ``Honour``: at or past its recorded end), a recorded call with no
result (``RunAgain``, ``Interrupt``), a commit of another action, or a commit
before all the recorded calls were made. The call then raises
:class:`Diverged`, which stops the handler: no model or tool is called.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar, cast

from google.protobuf.message import Message

from dagnats.core.errors import Unavailable
from dagnats.core.session_calls import SERVICE
from dagnats.journal import convert, replay
from dagnats.journal import model as jm
from dagnats.journal.v1 import journal_pb2 as jpb

R = TypeVar("R", bound=Message)

DivergenceKind = Literal[
    "different_call", "unrecorded_call", "unanswered_call", "missing_calls", "different_commit"
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Divergence:
    """Where new code parts from a recorded dispatch.

    Attributes:
        run_id: The recorded run.
        step_id: Its step.
        iteration: The dispatch's iteration.
        attempt: The dispatch's attempt.
        position: The journal position of the call (-1 for the commit).
        kind: ``different_call`` (another call than the recorded one at a
            position), ``unrecorded_call`` (a call the dispatch did not
            record: past its recorded end), ``unanswered_call`` (the recorded
            call has no result), ``missing_calls`` (committed before making
            every recorded call), ``different_commit`` (another commit action).
        recorded: What the recording holds there.
        asked: What the new code asked for.
        reason: The replay rule's words, when one decided.
        source: The export the run came from, if a file.
    """

    run_id: str
    step_id: str
    iteration: int
    attempt: int
    position: int
    kind: DivergenceKind
    recorded: str
    asked: str
    reason: str = ""
    source: str = ""

    def __str__(self) -> str:
        at = f"position {self.position}" if self.position >= 0 else "commit"
        why = f" ({self.reason})" if self.reason else ""
        return (
            f"run {self.run_id} step {self.step_id} iteration {self.iteration} attempt "
            f"{self.attempt} {at}: {self.kind}: recorded {self.recorded}; the new code "
            f"asked for {self.asked}{why}"
        )


class Diverged(BaseException):
    """Raised into the handler by a call that diverged: it stops the replay of
    the dispatch. A ``BaseException``, so that ``except Exception`` in a
    handler does not carry on past it."""

    def __init__(self, divergence: Divergence) -> None:
        super().__init__(str(divergence))
        self.divergence = divergence


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordedDispatch:
    """One dispatch ``(iteration, attempt)`` of a step as recorded, through
    its commit: what its handler was given, and what it stored.

    ``records`` are the iteration's, every attempt's, up to and including
    ``commit_seq``; ``state`` is the state the commit before the iteration
    stored (None: none), ``state_record`` that commit."""

    run_id: str
    step_id: str
    task_type: str
    workflow: str
    input: bytes
    settings: Mapping[str, str]
    iteration: int
    attempt: int
    base_seq: int
    records: tuple[jpb.Record, ...]
    commit: jpb.Commit
    commit_seq: int
    state: bytes | None = None
    state_record: jpb.Commit | None = None
    source: str = ""


class RecordedSession:
    """A :class:`~dagnats.sdk._session.Session` answered by a recorded
    dispatch's journal (see the module's docstring).

    Attributes:
        dispatch: The recorded dispatch.
        divergences: What diverged (the replay stops at the first).
        recorded_positions: One past the last position the dispatch recorded
            a call at.
    """

    def __init__(self, dispatch: RecordedDispatch) -> None:
        self.dispatch = dispatch
        self.divergences: list[Divergence] = []
        self._entries = tuple(convert.all_entries(dispatch.records))
        mine = [e for e in self._entries if e.attempt == dispatch.attempt]
        self.recorded_positions = replay.replay_positions(mine)
        self._asked_through = -1  # the last position the new code asked for
        self._ended = False

    async def call(
        self, method: str, request: Message, answer: type[R], trace_context: Mapping[str, str]
    ) -> R:
        if self._ended:
            raise Unavailable("the replayed dispatch ended")
        match method.removeprefix(SERVICE):
            case "BeginModel":
                found: Message = self._begin_model(cast(jpb.BeginModelRequest, request))
            case "BeginTool":
                found = self._begin_tool(cast(jpb.BeginToolRequest, request))
            case "BeginTools":
                found = self._begin_tools(cast(jpb.BeginToolsRequest, request))
            case "PlaceInputs":
                found = self._place_inputs(cast(jpb.PlaceInputsRequest, request))
            case "CheckTail":
                found = jpb.CheckTailResponse()
            case "Commit":
                found = self._commit(cast(jpb.CommitRequest, request))
            case other:
                # A call only a new model response or a tool that ran makes
                # (RecordModel, ToolOutput, FinishTool): nothing answered
                # above lets one happen.
                raise Unavailable(f"a replay answers no {other} call")
        assert isinstance(found, answer)
        return found

    def done(self) -> bool:
        return self._ended

    def cancel(self) -> bool:
        ended, self._ended = self._ended, True
        return not ended

    # ---- the calls ---------------------------------------------------------------------

    def _begin_model(self, request: jpb.BeginModelRequest) -> jpb.BeginModelResponse:
        position = self._asked(request.position)
        decision = replay.decide_model(
            self._entries, attempt=self.dispatch.attempt, position=position
        )
        match decision:
            case replay.UseResponse(response=response):
                return jpb.BeginModelResponse(recorded=True, response=response)
            case replay.Mismatch(reason=reason):
                raise self._diverge("different_call", position, "a model call", reason)
            case replay.CallModel():
                raise self._diverge("unrecorded_call", position, "a model call")

    def _begin_tool(self, request: jpb.BeginToolRequest) -> jpb.BeginToolResponse:
        position = self._asked(request.position)
        asked = _tool(request.name, request.input)
        decision = replay.decide_tool(
            self._entries,
            attempt=self.dispatch.attempt,
            position=position,
            call=_call_of(request),
        )
        match decision:
            case replay.UseResult(result=result):
                found = convert.result_to_proto(result)
                return jpb.BeginToolResponse(
                    token=request.token,
                    result=found,
                    key=self._key(request.token, position),
                    intent_seq=found.intent_seq,
                )
            case replay.Mismatch(reason=reason):
                raise self._diverge("different_call", position, asked, reason)
            case replay.RunAgain() | replay.Interrupt():
                raise self._diverge("unanswered_call", position, asked)
            case replay.RunNew() | replay.Honour():
                raise self._diverge("unrecorded_call", position, asked)

    def _begin_tools(self, request: jpb.BeginToolsRequest) -> jpb.BeginToolsResponse:
        first = request.position
        self._asked(first + len(request.calls) - 1)
        asked = "a parallel group of " + ", ".join(_tool(c.name, c.input) for c in request.calls)
        decision = replay.decide_tools(
            self._entries,
            attempt=self.dispatch.attempt,
            position=first,
            calls=[_call_of(c) for c in request.calls],
        )
        if isinstance(decision, replay.Mismatch):
            raise self._diverge("different_call", first, asked, decision.reason)
        answers = []
        for i, decided in enumerate(decision.calls):
            match decided:
                case replay.UseResult(result=result):
                    found = convert.result_to_proto(result)
                    answers.append(
                        jpb.BeginToolResponse(
                            result=found,
                            key=self._key(request.token, first + i),
                            intent_seq=found.intent_seq,
                            intent_index=found.intent_index,
                        )
                    )
                case replay.RunAgain() | replay.Interrupt():
                    raise self._diverge("unanswered_call", first + i, asked)
                case replay.RunNew() | replay.Honour():
                    raise self._diverge("unrecorded_call", first + i, asked)
        return jpb.BeginToolsResponse(token=request.token, calls=answers)

    def _place_inputs(self, request: jpb.PlaceInputsRequest) -> jpb.PlaceInputsResponse:
        position = self._asked(request.position)
        decision = replay.decide_place(
            self._entries, attempt=self.dispatch.attempt, position=position, mode=request.mode
        )
        asked = f"place_inputs (mode {request.mode})"
        match decision:
            case replay.ReplayPlaced(inputs=inputs):
                placed = [convert.placed_to_proto(e) for e in inputs]
                return jpb.PlaceInputsResponse(token=request.token, inputs=placed)
            case replay.PlaceNew(carry=()):
                # Nothing recorded here and nothing to carry: the inputs the
                # recording found queued (none) are the ones it placed.
                return jpb.PlaceInputsResponse(token=request.token)
            case replay.PlaceNew():
                raise self._diverge("unrecorded_call", position, asked)
            case replay.Mismatch(reason=reason):
                raise self._diverge("different_call", position, asked, reason)

    def _commit(self, request: jpb.CommitRequest) -> jpb.CommitResponse:
        asked = f"a {_action(request.commit)} commit"
        if self._asked_through + 1 < self.recorded_positions:
            raise self._diverge("missing_calls", self._asked_through + 1, asked)
        if request.commit.action != self.dispatch.commit.action:
            recorded = f"a {_action(self.dispatch.commit)} commit"
            raise self._diverge("different_commit", -1, asked, recorded=recorded)
        self._ended = True
        return jpb.CommitResponse(commit_seq=self.dispatch.commit_seq)

    # ---- divergences -------------------------------------------------------------------

    def _asked(self, position: int) -> int:
        self._asked_through = max(self._asked_through, position)
        return position

    def _diverge(
        self,
        kind: DivergenceKind,
        position: int,
        asked: str,
        reason: str = "",
        *,
        recorded: str | None = None,
    ) -> Diverged:
        d = self.dispatch
        if recorded is None:
            recorded = _recorded_at(self._entries, d.attempt, position, self.recorded_positions)
        divergence = Divergence(
            run_id=d.run_id,
            step_id=d.step_id,
            iteration=d.iteration,
            attempt=d.attempt,
            position=position,
            kind=kind,
            recorded=recorded,
            asked=asked,
            reason=reason,
            source=d.source,
        )
        self.divergences.append(divergence)
        self._ended = True
        return Diverged(divergence)

    @staticmethod
    def _key(token: jpb.WriterToken, position: int) -> str:
        return f"{token.run_id}.{token.step_id}.{token.iteration}.{position}"


def _call_of(request: jpb.BeginToolRequest | jpb.ToolCallSpec) -> jm.ToolCall:
    """The call the rules compare, as the journal service makes it."""
    return jm.ToolCall(
        name=request.name,
        input=request.input,
        safe=request.replay == jpb.REPLAY_SAFE,
        digest=request.digest,
        approval_id=request.approval.request_id if request.HasField("approval") else "",
    )


def _recorded_at(
    entries: Sequence[jm.AnyEntry], attempt: int, position: int, ended: int | None = None
) -> str:
    """What ``attempt`` recorded at ``position``, in words."""
    here = [
        e
        for e in entries
        if isinstance(e, jm.ModelEntry | jm.IntentEntry | jm.InputEntry)
        and (e.attempt, e.position) == (attempt, position)
    ]
    if not here:
        if ended is not None and position >= ended:
            return f"nothing: the calls end at position {ended - 1}"
        return "no call at this position"
    match here[-1]:
        case jm.ModelEntry():
            return "a model call"
        case jm.IntentEntry(name=name, input=data):
            return _tool(name, data)
        case _:
            return "place_inputs"


def _tool(name: str, data: bytes) -> str:
    text = data.decode(errors="replace")
    return f"tool {name!r} with input {text if len(text) <= 120 else text[:117] + '...'}"


def _action(commit: jpb.Commit) -> str:
    return jpb.Action.Name(commit.action).removeprefix("ACTION_").lower()
