"""A pydantic-ai ``Agent`` as the handler of an ``agent_loop`` step.

One iteration is one round of the agent: the steering inputs queued for the
step join the conversation, the agent makes one model request and the tool
calls its response asks for, and the iteration commits the message history
(``docs/adr/0018-pydantic-ai.md`` says why a round, not a whole run). The
round runs inside ``agent.iter`` and stops at the next model request; that
request, which carries the tool results, is the end of the history the
commit carries, and the next iteration resumes the run from it.

After a final answer the step continues with the answer as its output and
waits, holding no worker, until a follow-up arrives (the next turn answers
it) or the follow-up window passes (the step completes with the answer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic_ai.agent import AbstractAgent
from pydantic_ai.messages import ModelMessage, UserContent
from pydantic_core import to_jsonable_python

from dagnats.integrations.pydantic_ai._history import (
    content_text,
    dump_messages,
    load_messages,
    with_user_messages,
)
from dagnats.integrations.pydantic_ai._journaled import Journaled, Resume
from dagnats.sdk import (
    ApprovalPending,
    InputMode,
    InputsQueued,
    Journal,
    JournalSignal,
    PlacedInput,
    Replay,
    TaskContext,
)

ToolCalls = Literal["parallel", "sequential"]
"""How the tool calls of one model response run."""

FOLLOW_UP_WINDOW = 3600.0
"""Seconds an answered step waits for a follow-up, by default."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Round:
    messages: list[ModelMessage]
    answered: bool
    output: Any = None
    waiting: ApprovalPending | None = None  # a tool call waits for approval
    resume: Resume | None = None  # with waiting: what the next round replays

    def state(self) -> dict[str, Any]:
        state = {
            "messages": dump_messages(self.messages),
            "answered": self.answered,
            "output": self.output,
        }
        if self.resume is not None:
            state["resume"] = self.resume.dump()
        return state


@dataclass(frozen=True, slots=True, kw_only=True)
class DurableAgent:
    """The handler :func:`durable_agent` returns: ``await handler(tc)`` runs
    one round of ``agent`` for one iteration of its step."""

    agent: AbstractAgent[Any, Any]
    replay: Mapping[str, Replay] = field(default_factory=dict)
    stream: bool = False
    follow_up_window: float | None = FOLLOW_UP_WINDOW
    prompt: Callable[[Any], str | Sequence[UserContent]] = content_text
    deps: Callable[[TaskContext], Any] | None = None
    tool_calls: ToolCalls = "parallel"

    async def __call__(self, tc: TaskContext) -> None:
        try:
            await self._iteration(tc)
        except BaseExceptionGroup as group:
            # A journal signal raised inside a task pydantic-ai started comes
            # out in a group; the worker must see the signal itself.
            raise _signal_in(group) from None

    async def _iteration(self, tc: TaskContext) -> None:
        j = await tc.journal()  # first: the checkpoint comes with the claim
        state = await tc.load_checkpoint()
        steer = await tc.place_inputs(InputMode.STEER)
        messages: list[ModelMessage] | None = None
        loaded: list[ModelMessage] = []
        prompt: str | Sequence[UserContent] | None = None
        if state is None:  # the first round: the run's input is the prompt
            prompt = self.prompt(tc.input)
            if steer:
                opening = [prompt] if isinstance(prompt, str) else list(prompt)
                prompt = [*opening, *_texts(steer)]
        elif state["answered"]:
            placed = steer + await tc.place_inputs(InputMode.FOLLOW_UP)
            if not placed:  # the follow-up window passed with nothing to answer
                await tc.complete(state["output"])
                return
            # Each input is a user message of the next request, as steering is.
            loaded = load_messages(state["messages"])
            messages = with_user_messages(loaded, _texts(placed))
        else:  # a tool-round boundary: steering joins the pending request
            loaded = load_messages(state["messages"])
            messages = with_user_messages(loaded, _texts(steer))
        resume = Resume.load(state["resume"]) if state and "resume" in state else None
        done = await self._round(j, tc, prompt, messages, resume)
        await _save(tc, state, loaded, done)
        if done.waiting is not None:
            raise done.waiting  # the worker waits for the approval, holding nothing
        if not done.answered:
            await tc.continue_()
        elif self.follow_up_window is None:
            await tc.complete(done.output)
        else:
            try:
                await tc.continue_(done.output, until_input=True, delay=self.follow_up_window)
            except InputsQueued:
                await tc.continue_(done.output)  # the next turn places what was queued

    async def _round(
        self,
        j: Journal,
        tc: TaskContext,
        prompt: str | Sequence[UserContent] | None,
        messages: list[ModelMessage] | None,
        resume: Resume | None = None,
    ) -> _Round:
        """Run the agent up to its next model request after this one, or its end;
        or until a tool call waits for approval (``resume`` replays such a
        round's response and reuses its results)."""
        resume = resume or Resume()
        journaled = Journaled(
            journal=j,
            declared=self.replay,
            stream=self.stream,
            resume=resume,
            parallel=self.tool_calls == "parallel",
        )
        deps = self.deps(tc) if self.deps is not None else None
        # The calls pydantic-ai starts together run as one parallel group.
        with AbstractAgent.parallel_tool_call_execution_mode(self.tool_calls):
            async with self.agent.iter(
                prompt, message_history=messages, deps=deps, capabilities=[journaled]
            ) as run:
                node = run.next_node
                asked = False
                while not AbstractAgent.is_end_node(node):
                    if AbstractAgent.is_model_request_node(node):
                        if asked:  # the round is over; this request carries its results
                            return _Round(
                                messages=[*run.all_messages(), node.request], answered=False
                            )
                        asked = True
                    try:
                        node = await run.next(node)
                    except BaseException as err:
                        waiting = _approval_in(err)
                        if waiting is None:
                            raise
                        # The history up to the request the response answered
                        # (not the tool returns of a parallel group stopped by
                        # it): the next round sends it again and replays the
                        # response.
                        history = run.all_messages()
                        answered = len(history) - 1
                        while history[answered].kind != "response":
                            answered -= 1
                        cut = answered
                        return _Round(
                            messages=history[:cut], answered=False, waiting=waiting, resume=resume
                        )
                output = to_jsonable_python(node.data.output)
                return _Round(messages=run.all_messages(), answered=True, output=output)


def durable_agent(
    agent: AbstractAgent[Any, Any],
    *,
    safe_tools: Iterable[str] = (),
    replay: Mapping[str, Replay] | None = None,
    stream: bool = False,
    follow_up_window: float | None = FOLLOW_UP_WINDOW,
    prompt: Callable[[Any], str | Sequence[UserContent]] = content_text,
    deps: Callable[[TaskContext], Any] | None = None,
    tool_calls: ToolCalls = "parallel",
) -> DurableAgent:
    """A handler that runs ``agent`` durably, one round per iteration of an
    ``agent_loop`` step; register it with a ``Worker``.

    Every tool is ``Replay.UNSAFE`` (never started twice) unless declared
    safe: by name here, or with ``metadata=safe()`` on its pydantic-ai tool
    decorator. ``replay`` names a declaration per tool and wins over both.

    Args:
        agent: The pydantic-ai agent, with its model, tools and instructions.
        safe_tools: Names of tools that are harmless to run twice.
        replay: A declaration per tool name.
        stream: Stream each model request, its text going to the step's live
            stream (``GET /runs/{run}/steps/{step}/stream``) as it arrives.
        follow_up_window: Seconds an answered step waits, holding no worker,
            for a follow-up before it completes with its answer; None
            completes at the first answer.
        prompt: The run's input as the first user prompt (default: a string
            as is, ``{"text": ...}`` as its text, anything else as JSON).
        deps: Builds the agent's dependencies for each dispatch.
        tool_calls: ``"parallel"``: the tool calls of one model response run
            at once, as one parallel group (``Journal.tools``: every intent
            stored before any starts, each result as it finishes);
            ``"sequential"``: one at a time, in the response's order.

    Returns:
        ``async def handler(tc)``.
    """
    declared = {name: Replay.SAFE for name in safe_tools} | dict(replay or {})
    return DurableAgent(
        agent=agent,
        replay=declared,
        stream=stream,
        follow_up_window=follow_up_window,
        prompt=prompt,
        deps=deps,
        tool_calls=tool_calls,
    )


async def _save(tc: TaskContext, state: Any, loaded: list[ModelMessage], done: _Round) -> None:
    """Save the round's history: as the messages it appended to the stored
    history (the state chain stores only those), or whole when the round
    changed a stored message (steering joins the pending request) or an
    approval's resume point is set or cleared."""
    stored = len(loaded)
    resumes = done.resume is not None or (state is not None and "resume" in state)
    if state is not None and not resumes and _extends(done.messages, loaded, state["messages"]):
        await tc.append_state(
            "messages",
            dump_messages(done.messages[stored:]),
            answered=done.answered,
            output=done.output,
        )
    else:
        await tc.checkpoint(done.state())


def _extends(messages: list[ModelMessage], loaded: list[ModelMessage], dumped: list[Any]) -> bool:
    """Whether ``messages`` begins with the stored history ``loaded`` (whose
    dump is ``dumped``) unchanged: the same messages, the last one equal."""
    if not loaded or len(messages) < len(loaded):
        return False
    if any(a is not b for a, b in zip(messages, loaded[:-1], strict=False)):
        return False
    return bool(dump_messages([messages[len(loaded) - 1]]) == dumped[-1:])


def _approval_in(err: BaseException) -> ApprovalPending | None:
    """The approval a tool call waits for, raised alone or in a group."""
    if isinstance(err, ApprovalPending):
        return err
    if isinstance(err, BaseExceptionGroup):
        return next((e for e in _leaves(err) if isinstance(e, ApprovalPending)), None)
    return None


def _texts(placed: Sequence[PlacedInput]) -> list[str]:
    return [content_text(p.content) for p in placed]


def _signal_in(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The journal signal in ``group``, else its first exception that is not
    an ``Exception`` (a cancellation), else the group itself."""
    leaves = list(_leaves(group))
    for err in leaves:
        if isinstance(err, JournalSignal):
            return err
    return next((err for err in leaves if not isinstance(err, Exception)), group)


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterable[BaseException]:
    for err in group.exceptions:
        if isinstance(err, BaseExceptionGroup):
            yield from _leaves(err)
        else:
            yield err
