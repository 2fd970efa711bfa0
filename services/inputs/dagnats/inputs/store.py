"""The inputs service's one adapter to JetStream: the ``INPUTS`` bucket. The
run an input belongs to, and the history event that wakes a waiting step, are
the engine's, reached through :mod:`dagnats.inputs.peers`.

NATS error types do not leave this module. Two JetStream facts shape it
(docs/architecture.md, F6 and F7):

* A KV create carries no Msg-Id, so a retried create whose ack was lost looks
  exactly like losing the race to another caller. Every record therefore holds
  the nonce of the call that created it (``created_by``); after a "wrong last
  sequence" the record is read back, and our own nonce means the create was
  ours.
* Reads are hints. Every change is a compare-and-swap on the revision that was
  read (:meth:`InputStore.update`); a stale read only costs a retry.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, Callable
from types import TracebackType
from typing import Any, Self

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from dagnats.core import jetstream as jsx
from dagnats.core import tracing
from dagnats.core.errors import Unavailable
from dagnats.core.timestamps import timestamp
from dagnats.engine.v1 import engine_pb2 as epb
from dagnats.engine.v1 import internal_pb2 as eipb
from dagnats.inputs import convert, rules
from dagnats.inputs.peers import Runs
from dagnats.inputs.rules import InputState, Status
from dagnats.inputs.v1 import inputs_pb2 as pb

log = logging.getLogger(__name__)


RETRY_DEADLINE = 30.0
# How long the first values of a watch may take before the backend counts as down.
WATCH_START = 10.0


class StaleRevision(Exception):
    """The input changed since it was read; read it again and retry."""


def submitted_msg_id(run_id: str, step_id: str, request_id: str) -> str:
    # One event per input however often it is submitted: the Msg-Id dedupes.
    return f"{run_id}.{step_id}.input.{rules.encode_request_id(request_id)}"


def _decode_input(value: bytes | None) -> InputState:
    return convert.from_proto(pb.Input.FromString(value or b""))


class InputStore:
    """Inputs in the ``INPUTS`` bucket, keyed by :func:`dagnats.inputs.rules.key`."""

    def __init__(
        self,
        inputs: KeyValue,
        js: JetStreamContext,
        runs: Runs,
        *,
        dedupe_window: float = rules.DEDUPE_WINDOW,
    ) -> None:
        self._inputs = inputs
        self._js = js
        self._runs = runs
        # How long a request_id is promised the original, and an input may
        # wait queued (``rules.expired``): every reader of this store decides
        # with the same window.
        self.dedupe_window = dedupe_window

    @classmethod
    async def open(
        cls, nc: NATS, runs: Runs, *, dedupe_window: float = rules.DEDUPE_WINDOW
    ) -> InputStore:
        """The store over the bucket ``jsx.provision`` created; ``runs`` is the
        engine's (see :mod:`dagnats.inputs.peers`)."""
        js = nc.jetstream()
        return cls(await jsx.open_bucket(js, jsx.KV_INPUTS), js, runs, dedupe_window=dedupe_window)

    # ---- inputs -------------------------------------------------------------------

    async def create(self, state: InputState) -> tuple[InputState, bool]:
        """Store ``state`` unless its key exists.

        ``state.created_by`` must be a nonce fresh for this call: it is how a
        retried create whose first attempt landed is recognised as ours.

        Returns:
            The stored input and whether this call created it; for an existing
            key, the stored input unchanged.
        """
        name = rules.key(state.run_id, state.step_id, state.request_id)
        value = convert.to_proto(state).SerializeToString()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RETRY_DEADLINE
        while True:
            try:
                revision = await jsx.retry_transient(
                    lambda: self._inputs.create(name, value), "create"
                )
                log.debug("created input %s at revision %d", name, revision)
                return state, True
            except nats.js.errors.KeyWrongLastSequenceError:
                pass
            stored = await self.get(state.run_id, state.step_id, state.request_id)
            if stored is not None:
                current, _ = stored
                return current, current.created_by == state.created_by
            # The key exists but the read missed it (a stale replica, or it was
            # deleted in between): try the create again.
            if loop.time() > deadline:
                raise Unavailable(f"input {name} exists but cannot be read")
            await asyncio.sleep(0.05)

    async def get(
        self, run_id: str, step_id: str, request_id: str
    ) -> tuple[InputState, int] | None:
        """The input and its revision; None when there is none."""
        name = rules.key(run_id, step_id, request_id)
        try:
            entry = await jsx.retry_transient(lambda: self._inputs.get(name), "read an input")
        except nats.js.errors.KeyNotFoundError:
            return None
        return _decode_input(entry.value), int(entry.revision or 0)

    async def update(self, state: InputState, revision: int) -> int:
        """Replace the input stored at ``revision`` with ``state``.

        Returns:
            The new revision.

        Raises:
            StaleRevision: the input changed since ``revision`` (or an earlier
                attempt of this very update landed); read it again.
        """
        name = rules.key(state.run_id, state.step_id, state.request_id)
        value = convert.to_proto(state).SerializeToString()
        try:
            return int(
                await jsx.retry_transient(
                    lambda: self._inputs.update(name, value, revision), "update"
                )
            )
        except nats.js.errors.KeyWrongLastSequenceError:
            raise StaleRevision(name) from None

    async def list(self, run_id: str, step_id: str) -> list[tuple[InputState, int]]:
        """Every input of a step with its revision, oldest first.

        Read message by message (``jsx.walk_kv``), so listing creates no
        consumer: a consumer per call would pile up faster than the server
        removes idle ones.
        """
        keys = f"{rules.prefix(run_id, step_id)}>"
        found = [
            (_decode_input(value), revision)
            async for _, value, revision in jsx.walk_kv(self._js, jsx.KV_INPUTS, keys)
        ]
        return sorted(found, key=lambda pair: (pair[0].created_at, pair[0].request_id))

    async def queued(self, run_id: str, step_id: str, now: float) -> builtins.list[InputState]:
        """The queued inputs of a step that may still be placed, oldest first:
        one queued longer than the dedupe window is not (``rules.expired``)."""
        listed = await self.list(run_id, step_id)
        return [
            state
            for state, _ in listed
            if state.status is Status.QUEUED
            and not rules.expired(state, now=now, window=self.dedupe_window)
        ]

    async def purge_run(self, run_id: str) -> None:
        """Remove every input of a run, which is being purged."""
        purge = functools.partial(
            self._js.purge_stream, f"KV_{jsx.KV_INPUTS}", subject=f"$KV.{jsx.KV_INPUTS}.{run_id}.>"
        )
        await jsx.retry_transient(purge, "purge the inputs")

    def watch(self, run_id: str, step_id: str, request_id: str) -> InputWatch:
        """Follow one input and its run (``async with store.watch(...) as w``)."""
        return InputWatch(self._inputs, self._runs, run_id, step_id, request_id)

    async def wait_change(
        self,
        run_id: str,
        step_id: str,
        request_id: str,
        status: Status,
        timeout: float,  # noqa: ASYNC109 - a deadline for a watch, returned at, not raised
    ) -> InputState | None:
        """Wait until the stored status differs from ``status``.

        Returns:
            The input as soon as its stored status differs, or as it is at the
            deadline; None when there is no such input.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with self.watch(run_id, step_id, request_id) as watch:
            while watch.input is not None and watch.input.status is status:
                if not await watch.next(deadline - loop.time()):
                    break
            return watch.input

    # ---- runs and history -----------------------------------------------------------

    async def load_run(self, run_id: str) -> epb.Run | None:
        """The engine's view of a run; None when there is none."""
        return await self._runs.get_run(run_id)

    async def publish_submitted(self, state: InputState, now: float) -> None:
        """Tell the engine the step has an input, so a step waiting for one wakes."""
        event = eipb.HistoryEvent(
            run_id=state.run_id,
            step_id=state.step_id,
            time=timestamp(now),
            input=eipb.InputSubmitted(request_id=state.request_id),
        )
        tracing.inject(event.trace_context)  # type: ignore[arg-type]
        msg_id = submitted_msg_id(state.run_id, state.step_id, state.request_id)
        try:
            await self._runs.publish_event(event, msg_id)
        except jsx.TRANSIENT_NATS_ERRORS as err:
            raise Unavailable(f"could not publish the input event: {err!r}") from err


class InputWatch:
    """The latest stored input and run, kept current by two KV watches.

    ``input`` and ``run`` hold the values as of the last change (None when the
    key does not exist); :meth:`next` waits for the next change of either.
    """

    def __init__(
        self, inputs: KeyValue, runs: Runs, run_id: str, step_id: str, request_id: str
    ) -> None:
        self._inputs = inputs
        self._runs = runs
        self._run_id = run_id
        self._key = rules.key(run_id, step_id, request_id)
        self.input: InputState | None = None
        self.run: epb.Run | None = None
        self._changed = asyncio.Event()
        self._pumps: list[asyncio.Task[None]] = []
        self._follows: list[AsyncGenerator[Any, None]] = []

    async def __aenter__(self) -> Self:
        try:
            # The input last: its first value is the one a caller compares
            # with, so nothing may change it between that read and the return.
            await self._follow_run()
            await self._follow(self._inputs, self._key, self._set_input)
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    async def next(self, timeout: float) -> bool:  # noqa: ASYNC109 - returns False at the deadline
        """Wait up to ``timeout`` seconds for a change; False when none came."""
        if timeout <= 0 and not self._changed.is_set():
            return False
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                await self._changed.wait()
        except TimeoutError:
            return False
        self._changed.clear()
        return True

    async def _follow(self, kv: KeyValue, key: str, apply: Callable[[Any], None]) -> None:
        follow = jsx.follow_key(kv, key)
        self._follows.append(follow)
        try:
            async with asyncio.timeout(WATCH_START):
                apply(await anext(follow))
        except TimeoutError:
            raise Unavailable(f"watching {key} timed out") from None
        self._pumps.append(asyncio.create_task(self._pump(follow, apply)))

    async def _follow_run(self) -> None:
        follow = self._runs.follow_run(self._run_id)
        self._follows.append(follow)
        try:
            async with asyncio.timeout(WATCH_START):
                self.run = await anext(follow)
        except TimeoutError:
            raise Unavailable(f"watching run {self._run_id} timed out") from None
        self._pumps.append(asyncio.create_task(self._pump_run(follow)))

    async def _pump_run(self, follow: AsyncGenerator[epb.Run | None, None]) -> None:
        async for run in follow:
            self.run = run
            self._changed.set()

    async def _pump(self, follow: AsyncGenerator[Any, None], apply: Callable[[Any], None]) -> None:
        async for entry in follow:
            try:
                apply(entry)
            except Exception:
                log.exception("cannot decode %s", entry.key)
                continue
            self._changed.set()

    def _set_input(self, entry: Any) -> None:
        self.input = _decode_input(entry.value) if entry and entry.value else None

    async def _close(self) -> None:
        for pump in self._pumps:
            pump.cancel()
        for pump in self._pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await pump
        for follow in self._follows:
            with contextlib.suppress(Exception):
                await follow.aclose()


async def close_step_inputs(
    store: InputStore, run_id: str, step_id: str, step: rules.StepProgress, now: float
) -> int:
    """End every input of a finished step that has not ended yet
    (``rules.at_step_end``): a queued one ``unanswered`` (or ``expired``), one
    placed into an iteration that never committed ``dropped``.

    Returns:
        How many inputs this call changed.
    """
    changed = 0
    window = store.dedupe_window
    for state, revision in await store.list(run_id, step_id):
        _, ended = await change(
            store, state, revision, lambda s: rules.at_step_end(s, step, now=now, window=window)
        )
        changed += ended
    return changed


async def close_input(
    store: InputStore, state: InputState, revision: int, now: float
) -> tuple[InputState | None, bool]:
    """Mark one input ``unanswered`` (or ``expired``) if it is still queued
    (see :func:`change`): one placed or withdrawn meanwhile keeps that status.

    Returns:
        The input as stored afterwards (None when it is gone) and whether this
        call changed it.
    """
    window = store.dedupe_window
    return await change(
        store, state, revision, lambda current: rules.close(current, now=now, window=window)
    )


async def expire_input(
    store: InputStore, state: InputState, revision: int, now: float
) -> tuple[InputState | None, bool]:
    """Mark one input ``expired`` if it is still queued and older than the
    dedupe window (see :func:`change`).

    Returns:
        The input as stored afterwards (None when it is gone) and whether this
        call changed it.
    """
    window = store.dedupe_window
    return await change(
        store, state, revision, lambda current: rules.expire(current, now=now, window=window)
    )


async def change(
    store: InputStore,
    state: InputState,
    revision: int,
    decide: Callable[[InputState], InputState | None],
) -> tuple[InputState | None, bool]:
    """Write what ``decide`` makes of the input, with compare-and-swap on the
    revision it was read at; None from ``decide``: nothing changes.

    An input that changed since it was read is read again and decided again.
    That covers another writer's change (a withdrawal that won against a
    placement reads as withdrawn, and ``decide`` refuses it) and this call's own
    write whose answer was lost: a retried update finds the revision moved on
    even though it was this very write that moved it, so a refused update is
    never taken to mean that someone else's change won.

    Returns:
        The input as stored afterwards (None when it is gone) and whether this
        call changed it.

    Raises:
        Unavailable: the input kept changing for ``RETRY_DEADLINE`` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RETRY_DEADLINE
    while True:
        moved = decide(state)
        if moved is None:
            return state, False
        try:
            await store.update(moved, revision)
            return moved, True
        except StaleRevision:
            if loop.time() > deadline:
                raise Unavailable(f"input {state.request_id!r} keeps changing") from None
            stored = await store.get(state.run_id, state.step_id, state.request_id)
            if stored is None:
                return None, False
            state, revision = stored


__all__ = [
    "InputStore",
    "InputWatch",
    "StaleRevision",
    "change",
    "close_input",
    "close_step_inputs",
    "expire_input",
    "submitted_msg_id",
]
