"""A step's live preview as server-sent events, one subscription per step.

The gateway holds one ``WatchStream`` (one NATS subscription in the journal
service) per step, however many readers follow it: a :class:`StepHub` reads
it, applies the rules below, keeps the last ``RING`` events, and hands each
event to every reader's own bounded queue. A reader that falls ``READER_BUFFER``
events behind is cut off (it resumes with ``Last-Event-ID``), so a slow reader
slows neither the worker nor the other readers.

The rules that tie the preview to the journal:

- a ``claim`` abandons every open stream of another writer (``abandoned``,
  reason ``superseded``), and from then on chunks of any writer but the
  claim's are dropped: a fenced holder's chunks are never shown as current;
- the first stream of a position that an abandoned stream had carries
  ``retry_of``, the abandoned stream's id;
- a stream ends with ``committed`` (the model record's sequence and its
  response) or ``abandoned``; later chunks of it are dropped;
- chunks the hub could not take in time (its ``WatchStream`` fell behind) are
  a ``gap`` event in their place (``first_seq``..``last_seq``, ``dropped``);
  markers are never dropped.

Event ids are ``<writer>.<position>.<seq>`` (``.committed``/``.abandoned``
for markers), so a reconnect with ``Last-Event-ID`` resumes right after that
event for as long as the hub holds it (``LINGER`` seconds after its last
reader left). A reader that connects without one gets, for a stream already
committed, only its ``committed`` event, and when the hub is new, the step's
model records from the journal as ``committed`` events: the final text
either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import AsyncIterator

from fastapi import Request

from dagnats.core.errors import DagnatsError
from dagnats.gateway import sse
from dagnats.gateway.backend import Backend
from dagnats.journal.stream import Event

RING = 4096  # events a hub keeps for readers that reconnect
READER_BUFFER = 4096  # events one reader may fall behind before it is cut off
LINGER = 60.0  # seconds a hub outlives its last reader
_CUT = object()
_CHUNKS = frozenset({"token", "gap"})  # what a committed stream's record stands for


class StepHub:
    """One step's subscription and the readers that follow it."""

    def __init__(self, hubs: Hubs, backend: Backend, run_id: str, step_id: str) -> None:
        self._hubs = hubs
        self._backend = backend
        self.key = (run_id, step_id)
        self.ring: deque[Event] = deque(maxlen=RING)
        self.committed: set[str] = set()  # streams whose record is stored
        self.readers: set[asyncio.Queue[Event | object]] = set()
        self.fresh = True  # nothing published reached this hub yet
        self._ready = asyncio.Event()
        self._failed: DagnatsError | None = None
        self._task = asyncio.create_task(self._pump(), name=f"live-{run_id}-{step_id}")
        self._linger: asyncio.TimerHandle | None = None

    async def ready(self) -> None:
        await self._ready.wait()
        if self._failed is not None:
            raise self._failed

    async def _pump(self) -> None:
        try:
            async for event_id, data in self._backend.journal.watch_stream(*self.key):
                if not event_id:
                    self._ready.set()
                    continue
                event = Event(event_id, data["type"], data)
                if event.type == "committed":
                    self.committed.add(data["stream"])
                self.fresh = False
                self.ring.append(event)
                for queue in list(self.readers):
                    try:
                        queue.put_nowait(event)
                    except asyncio.QueueFull:
                        self.readers.discard(queue)
                        queue.get_nowait()  # room for the cut marker
                        queue.put_nowait(_CUT)
        except DagnatsError as err:
            self._failed = err
        finally:
            self._ready.set()
            for queue in list(self.readers):
                with contextlib.suppress(asyncio.QueueFull):
                    queue.put_nowait(_CUT)
            self._hubs.forget(self)

    def join(self) -> asyncio.Queue[Event | object]:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        queue: asyncio.Queue[Event | object] = asyncio.Queue(READER_BUFFER)
        self.readers.add(queue)
        return queue

    def leave(self, queue: asyncio.Queue[Event | object]) -> None:
        self.readers.discard(queue)
        if not self.readers and self._linger is None:
            self._linger = asyncio.get_running_loop().call_later(LINGER, self.close)

    def close(self) -> None:
        self._task.cancel()

    def backlog(self, last_event_id: str | None) -> list[Event]:
        """The ring's events a reader gets before the live ones: those after
        ``last_event_id`` when the ring holds it, else all but the tokens of
        committed streams (their ``committed`` event carries the text) and
        the gaps in them."""
        events = list(self.ring)
        ids = [e.id for e in events]
        if last_event_id in ids:
            return events[ids.index(last_event_id) + 1 :]
        committed = self.committed
        return [e for e in events if e.type not in _CHUNKS or e.data["stream"] not in committed]


class Hubs:
    """The gateway's hubs, one per followed step."""

    def __init__(self) -> None:
        self._hubs: dict[tuple[str, str], StepHub] = {}

    async def hub(self, backend: Backend, run_id: str, step_id: str) -> StepHub:
        found = self._hubs.get((run_id, step_id))
        if found is None:
            found = self._hubs[(run_id, step_id)] = StepHub(self, backend, run_id, step_id)
        await found.ready()
        return found

    def forget(self, hub: StepHub) -> None:
        if self._hubs.get(hub.key) is hub:
            del self._hubs[hub.key]

    def __len__(self) -> int:
        return len(self._hubs)

    def close(self) -> None:
        for hub in list(self._hubs.values()):
            hub.close()


async def journal_committed(backend: Backend, run_id: str, step_id: str) -> list[Event]:
    """The step's model responses, as the ``committed`` events a late reader
    gets: those in records of their own, and those stored ahead of an intent
    or a commit."""
    out = []
    async for record in backend.journal.read(run_id, step_id):
        if record.HasField("model") or record.HasField("leading_model"):
            model = record.model if record.HasField("model") else record.leading_model
            data = {
                "type": "committed",
                "run": run_id,
                "step": step_id,
                "iteration": record.iteration,
                "attempt": record.attempt,
                "position": model.position,
                "record_seq": record.seq,
                "response": json.loads(model.response),
                "from": "journal",
            }
            out.append(Event(f"journal.{record.seq}", "committed", data))
    return out


def _call(event: Event) -> tuple[int, int]:
    return event.data["iteration"], event.data["position"]


async def events(
    request: Request, backend: Backend, hub: StepHub, last_event_id: str | None
) -> AsyncIterator[str]:
    """Yield the SSE text of a step's live preview until the client leaves."""
    queue = hub.join()
    streams = request.app.state.metrics.streams
    streams.inc()
    try:
        # The backlog is read before the client is told it follows the stream,
        # so what it gets from now on comes after it.
        backlog = hub.backlog(last_event_id)
        if not backlog and hub.fresh and not last_event_id:
            backlog = await journal_committed(backend, *hub.key)
        sent = {e.id for e in backlog}
        # Positions whose record the backlog already gave: their live events are older news.
        done = {_call(e) for e in backlog if e.type == "committed"}
        yield "retry: 1000\n\n"
        for event in backlog:
            yield event.sse()
        while True:
            item = await sse.next_item(request, queue)
            if item is None:
                return
            if isinstance(item, sse.Quiet):
                yield sse.KEEPALIVE
                continue
            if item is _CUT:
                return  # too slow, or the subscription ended: reconnect with Last-Event-ID
            assert isinstance(item, Event)
            if item.id in sent or (item.type != "abandoned" and _call(item) in done):
                continue
            yield item.sse()
    finally:
        streams.dec()
        hub.leave(queue)
