"""What the processes send through nats-server, by kind: one core NATS
subscription to every subject of the account (``>``) sees every message
published in it, and each is counted under :func:`kind`.

The kinds a client sends into nats-server (``/varz`` ``in_msgs``) are named
by what they do: ``append JOURNAL`` (a journal record), ``write RUNS`` (a
run's write, a key of the runs bucket), ``get KV_RUNS`` (a read of one
message of a stream), ``ack TASKS``, ``pull TASKS``, ``api CONSUMER.CREATE``,
``publish dagnats.stream`` (a core NATS subject) and the like. What
nats-server sends out is counted apart, under ``out``: a reply to a request
(``out reply``) and a message a consumer delivers, seen with its stream's
subject and a ``$JS.ACK`` reply (``out delivered KV_RUNS``). nats-server's
advisories are ``out advisory``.

The subscription is a client of its own: it adds the messages it receives
to what nats-server sends, and takes CPU on the machine; on a cluster every
message published at another member also crosses a route to the
subscription's member, which adds to what the members send each other. So
a bench counts kinds only when asked (``BENCH_KINDS=1``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

# The first token of the subjects of this project's streams and core NATS
# messages, and what a publish to each is.
_OURS = {
    "journal": "append JOURNAL",
    "tasks": "publish TASKS",
    "history": "publish HISTORY",
    "timers": "publish TIMERS",
    "created": "publish RUNS_CREATED",
    "api": "request api",
}


def kind(subject: str, reply: str) -> str:
    """What a message seen on ``subject`` with ``reply`` is (see the module)."""
    tokens = subject.split(".")
    if reply.startswith("$JS.ACK."):
        return f"out delivered {reply.split('.')[2]}"
    if tokens[0].startswith("_INBOX") or tokens[0].startswith("_R_"):
        return "out reply"
    if tokens[0] == "$JS":
        return _jetstream(tokens)
    if tokens[0] == "$KV" and len(tokens) > 1:
        return f"write {tokens[1]}"
    if tokens[0] in _OURS:
        return _OURS[tokens[0]]
    return "publish " + ".".join(tokens[:2])


def _jetstream(tokens: list[str]) -> str:
    if tokens[1] == "ACK" and len(tokens) > 2:
        return f"ack {tokens[2]}"
    if tokens[1] == "EVENT":
        return "out advisory"
    if tokens[1] != "API":
        return "$JS " + ".".join(tokens[1:3])
    rest = tokens[2:]
    if rest[:3] == ["STREAM", "MSG", "GET"] and len(rest) > 3:
        return f"get {rest[3]}"
    if rest[:2] == ["DIRECT", "GET"] and len(rest) > 2:
        return f"get {rest[2]}"
    if rest[:3] == ["CONSUMER", "MSG", "NEXT"] and len(rest) > 3:
        return f"pull {rest[3]}"
    return "api " + ".".join(rest[:2])


class Kinds:
    """The messages of one NATS connection's account, counted by kind."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()
        self._nc: Any = None

    async def start(self, servers: list[str]) -> None:
        import nats

        self._nc = await nats.connect(servers, name="bench-message-kinds")

        async def seen(msg: Any) -> None:
            self.seen[kind(msg.subject, msg.reply or "")] += 1

        # No pending limits: a message dropped here would go uncounted.
        await self._nc.subscribe(">", cb=seen, pending_msgs_limit=0, pending_bytes_limit=0)
        await self._nc.flush()

    def snapshot(self) -> dict[str, int]:
        return dict(self.seen)

    async def stop(self) -> None:
        if self._nc is not None:
            await self._nc.close()


def per_iteration(
    before: Mapping[str, int], after: Mapping[str, int], iterations: int
) -> dict[str, float]:
    """Each kind's messages between two snapshots, an iteration."""
    return {
        name: round((after.get(name, 0) - before.get(name, 0)) / iterations, 3)
        for name in sorted(set(before) | set(after))
        if after.get(name, 0) != before.get(name, 0)
    }
