"""The fenced append adapter against a real nats-server, on one server (R1) and
on a 3-node loopback cluster (R3): the two answer a retried write differently
(docs/architecture.md, F2), so every fencing case runs on both."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats.js.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from dagnats.core import jetstream as jsx
from dagnats.core.errors import Fenced
from dagnats.journal.store import JournalStore, journal_subject
from dagnats.journal.v1 import journal_pb2 as pb

STEP = "agent"


@dataclass
class Backend:
    name: str
    nc: NATS
    js: JetStreamContext
    store: JournalStore


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(topology: tuple[str, str, int]) -> AsyncIterator[Backend]:
    name, url, replicas = topology
    nc = await jsx.connect(url, name=f"test-journal-store-{name}")
    try:
        js = nc.jetstream()
        await jsx.provision(js, jsx.Topology(replicas=replicas))
        info = await js.stream_info(jsx.JOURNAL)
        assert info.config.num_replicas == replicas
        yield Backend(name=name, nc=nc, js=js, store=JournalStore(nc))
    finally:
        await nc.close()


def new_run() -> str:
    return secrets.token_hex(16)


def nonce() -> str:
    return secrets.token_hex(8)


def token(
    run: str,
    *,
    writer: str,
    last_seq: int,
    written: int = 0,
    iteration: int = 0,
    attempt: int = 1,
    step: str = STEP,
) -> pb.WriterToken:
    return pb.WriterToken(
        run_id=run,
        step_id=step,
        iteration=iteration,
        attempt=attempt,
        writer=writer,
        last_seq=last_seq,
        written=written,
    )


def stamped(t: pb.WriterToken, record: pb.Record) -> pb.Record:
    """The record as the journal service writes it under token ``t``."""
    record.run_id = t.run_id
    record.step_id = t.step_id
    record.iteration = t.iteration
    record.attempt = t.attempt
    record.writer = t.writer
    record.expected_seq = t.last_seq
    return record


def claim(t: pb.WriterToken, delivery: int = 1) -> pb.Record:
    return stamped(t, pb.Record(claim=pb.Claim(delivery=delivery, worker_id=f"w-{t.writer}")))


def model(t: pb.WriterToken, position: int, text: str) -> pb.Record:
    response = f'{{"text": "{text}"}}'.encode()
    return stamped(t, pb.Record(model=pb.ModelCall(position=position, response=response)))


def writers(records: list[pb.Record]) -> list[tuple[int, str, str]]:
    return [(r.seq, r.writer, r.WhichOneof("kind") or "") for r in records]


async def test_retried_append_whose_ack_was_lost_resolves_as_mine(backend: Backend) -> None:
    run, a = new_run(), nonce()
    t = token(run, writer=a, last_seq=0)
    record = claim(t)
    seq = await backend.store.append(t, record)
    # The ack of the first try was lost; the writer sends the same write again
    # (same token, so the same Msg-Id and the same expected tail).
    assert await backend.store.append(t, record) == seq
    assert writers(await backend.store.read(run, STEP, after=0)) == [(seq, a, "claim")]
    last = await backend.js.get_last_msg(jsx.JOURNAL, journal_subject(run, STEP))
    assert last.seq == seq


async def test_a_token_sent_again_for_another_record_of_the_same_kind_is_fenced(
    backend: Backend,
) -> None:
    # A writer that lost track of its latest token sends the one it already
    # wrote with, for another model response: the record under that Msg-Id
    # records something else, so this write is behind, not a retry of it.
    run, a = new_run(), nonce()
    t = token(run, writer=a, last_seq=0)
    first = await backend.store.append(t, claim(t))
    t2 = token(run, writer=a, last_seq=first, written=1)
    seq = await backend.store.append(t2, model(t2, 0, "first"))
    with pytest.raises(Fenced):
        await backend.store.append(t2, model(t2, 0, "another"))
    records = await backend.store.read(run, STEP, after=0)
    assert writers(records) == [(first, a, "claim"), (seq, a, "model")]
    assert records[-1].model.response == b'{"text": "first"}'


async def test_server_answers_a_retried_append_differently_on_r1_and_r3(
    backend: Backend,
) -> None:
    """Why the adapter has two paths to "mine" (docs/architecture.md, F2)."""
    subject = journal_subject(new_run(), STEP)
    headers = {"Nats-Msg-Id": f"{subject}.{nonce()}", "Nats-Expected-Last-Subject-Sequence": "0"}
    first = await backend.js.publish(subject, b"x", headers=headers)
    if backend.name == "r3":
        again = await backend.js.publish(subject, b"x", headers=headers)
        assert (again.seq, again.duplicate) == (first.seq, True)
    else:
        with pytest.raises(nats.js.errors.APIError) as err:
            await backend.js.publish(subject, b"x", headers=headers)
        assert err.value.err_code == 10071


async def test_retried_append_resolves_as_mine_after_a_successor_wrote_behind_it(
    backend: Backend,
) -> None:
    run, a, b = new_run(), nonce(), nonce()
    a0 = token(run, writer=a, last_seq=0)
    s1 = await backend.store.append(a0, claim(a0))
    a1 = token(run, writer=a, last_seq=s1, written=1)
    a_model = model(a1, 0, "from a")
    s2 = await backend.store.append(a1, a_model)
    # A stalls before it sees the ack of s2; B (a redelivery) claims behind it.
    b0 = token(run, writer=b, last_seq=s2)
    s3 = await backend.store.append(b0, claim(b0, delivery=2))
    # A's retry of the write at s2 is its own, not a fence.
    assert await backend.store.append(a1, a_model) == s2
    assert writers(await backend.store.read(run, STEP, after=0)) == [
        (s1, a, "claim"),
        (s2, a, "model"),
        (s3, b, "claim"),
    ]


async def test_writer_with_a_stale_view_is_fenced(backend: Backend) -> None:
    run, a, b = new_run(), nonce(), nonce()
    ta = token(run, writer=a, last_seq=0)
    s1 = await backend.store.append(ta, claim(ta))
    # B (the retry, attempt 2) read the journal before A claimed.
    tb = token(run, writer=b, last_seq=0, attempt=2)
    with pytest.raises(Fenced) as fenced:
        await backend.store.append(tb, claim(tb))
    assert (fenced.value.expected, fenced.value.actual) == (0, s1)
    assert writers(await backend.store.read(run, STEP, after=0)) == [(s1, a, "claim")]


async def test_writer_behind_a_later_record_is_fenced_with_the_tail_it_missed(
    backend: Backend,
) -> None:
    run, a, b = new_run(), nonce(), nonce()
    a0 = token(run, writer=a, last_seq=0)
    s1 = await backend.store.append(a0, claim(a0))
    b0 = token(run, writer=b, last_seq=s1)
    s2 = await backend.store.append(b0, claim(b0, delivery=2))
    b1 = token(run, writer=b, last_seq=s2, written=1)
    s3 = await backend.store.append(b1, model(b1, 0, "from b"))
    a1 = token(run, writer=a, last_seq=s1, written=1)
    with pytest.raises(Fenced) as fenced:
        await backend.store.append(a1, model(a1, 0, "from a"))
    assert (fenced.value.expected, fenced.value.actual) == (s1, s3), "actual is the tail"
    assert [seq for seq, *_ in writers(await backend.store.read(run, STEP, after=0))] == [
        s1,
        s2,
        s3,
    ]


async def test_zombie_reusing_its_successors_identity_is_fenced(backend: Backend) -> None:
    """A stalled worker and its replacement receive the same task message, so
    they share run, step, iteration and attempt; when both claim from the same
    tail they also share the written counter and the expected sequence. Only the
    claim's random writer nonce tells their records apart.

    Without the nonce in the Msg-Id the zombie's write would carry its
    successor's Msg-Id: on R3 the server checks the Msg-Id *before* the expected
    sequence and answers ``duplicate`` with the successor's sequence
    (docs/architecture.md, F3), and on R1 the read-back after 10071 would find
    a record with "its" Msg-Id. Either way the zombie would believe it wrote,
    and go on to start a tool or commit. With the nonce its Msg-Id is new, the expected sequence is
    checked, and the write is fenced.
    """
    run, successor, zombie = new_run(), nonce(), nonce()
    s0 = token(run, writer=successor, last_seq=0, attempt=2)
    s1 = await backend.store.append(s0, claim(s0, delivery=2))
    s1_token = token(run, writer=successor, last_seq=s1, written=1, attempt=2)
    s2 = await backend.store.append(s1_token, model(s1_token, 0, "successor"))

    # The zombie's claim: the same identity and expected tail as the successor's claim.
    z0 = token(run, writer=zombie, last_seq=0, attempt=2)
    with pytest.raises(Fenced) as fenced:
        await backend.store.append(z0, claim(z0, delivery=1))
    assert (fenced.value.expected, fenced.value.actual) == (0, s2)

    # The zombie's next record: identical to the successor's model write but for the nonce.
    z1 = token(run, writer=zombie, last_seq=s1, written=1, attempt=2)
    with pytest.raises(Fenced) as fenced:
        await backend.store.append(z1, model(z1, 0, "zombie"))
    assert (fenced.value.expected, fenced.value.actual) == (s1, s2)

    assert writers(await backend.store.read(run, STEP, after=0)) == [
        (s1, successor, "claim"),
        (s2, successor, "model"),
    ]


async def test_tail_reads_the_last_record_with_its_sequence(backend: Backend) -> None:
    run, a = new_run(), nonce()
    assert await backend.store.tail(run, STEP) is None
    t0 = token(run, writer=a, last_seq=0)
    s1 = await backend.store.append(t0, claim(t0))
    t1 = token(run, writer=a, last_seq=s1, written=1)
    s2 = await backend.store.append(t1, model(t1, 0, "hello"))
    # Another step of the run writes later; the tail is per step.
    other = token(run, writer=nonce(), last_seq=0, step="other")
    await backend.store.append(other, claim(other))

    tail = await backend.store.tail(run, STEP)
    assert tail is not None
    assert (tail.seq, tail.writer, tail.WhichOneof("kind")) == (s2, a, "model")
    assert tail.model.response == b'{"text": "hello"}'
    assert tail.expected_seq == s1


async def test_read_pages_a_steps_records_from_a_sequence(backend: Backend) -> None:
    run, a = new_run(), nonce()
    seqs: list[int] = []
    last = 0
    for written in range(5):
        t = token(run, writer=a, last_seq=last, written=written)
        record = claim(t) if written == 0 else model(t, written - 1, f"r{written}")
        last = await backend.store.append(t, record)
        seqs.append(last)
        # Interleave another step so the step's sequences are not contiguous.
        o = token(run, writer=nonce(), last_seq=0, step=f"other{written}")
        await backend.store.append(o, claim(o))

    store = backend.store
    assert [r.seq for r in await store.read(run, STEP, after=0)] == seqs
    assert [r.seq for r in await store.read(run, STEP, after=seqs[1])] == seqs[2:]
    assert [r.seq for r in await store.read(run, STEP, after=seqs[1] - 1)] == seqs[1:]
    assert [r.seq for r in await store.read(run, STEP, after=0, limit=2)] == seqs[:2]
    assert [r.seq for r in await store.read(run, STEP, after=0, through=seqs[2])] == seqs[:3]
    assert [r.seq for r in await store.read(run, STEP, after=seqs[0], limit=2)] == seqs[1:3]
    assert await store.read(run, STEP, after=seqs[-1]) == []
    page = await store.read(run, STEP, after=seqs[0], limit=1)
    assert [(r.seq, r.model.response) for r in page] == [(seqs[1], b'{"text": "r1"}')]
