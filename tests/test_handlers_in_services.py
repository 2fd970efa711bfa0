"""Handlers run in the services' own process (``--handlers``, ADR 44).

Their journal calls are answered by the process's journal servicer without
gRPC; what a user checks is that nothing else changes: the same records, the
same errors, and clear refusals of bad flags. The same guarantee across a
crash: ``tests/test_journal.py`` runs its unsafe-intent crash with a worker of
its own and with handlers in the services' process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import grpc.aio
import pytest
import trustme

from dagnats.cli.main import main
from dagnats.core import errors
from dagnats.core.frames import TransportError
from dagnats.core.natsserver import NatsServer
from dagnats.engine.local_transport import LocalSession, Method
from dagnats.engine.server import EngineServer
from dagnats.engine.v1 import engine_pb2 as pb
from dagnats.journal.v1 import journal_pb2 as jpb
from dagnats.sdk import Client, Credentials, run_output
from tests.stack import loop_workflow, start_dev, unique
from tests.test_journal import hosted, run_without_a_crash


async def test_a_run_of_handlers_in_the_services_process_writes_what_a_worker_writes(
    client: Client, engine: EngineServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[LocalSession] = []
    local_session = engine.local_session

    def counted() -> LocalSession:
        opened.append(local_session())
        return opened[-1]

    monkeypatch.setattr(engine, "local_session", counted)
    await run_without_a_crash(client, engine, hosted)
    assert opened, "the journal calls went through the process's own servicer"


# ---- the session in the process ------------------------------------------------------


CHECK_TAIL = "/dagnats.journal.v1.JournalService/CheckTail"


class Servicer:
    """Stands for the journal servicer: its ``check_tail`` answers or raises."""

    def __init__(self, raises: BaseException | None = None) -> None:
        self.raises = raises
        self.seen: list[jpb.CheckTailRequest] = []

    async def check_tail(self, request: jpb.CheckTailRequest) -> jpb.CheckTailResponse:
        self.seen.append(request)
        if self.raises is not None:
            raise self.raises
        return jpb.CheckTailResponse()


def local(servicer: Servicer) -> LocalSession:
    """A session on a method table of one entry, the servicer's ``check_tail``."""
    return LocalSession({CHECK_TAIL: Method(jpb.CheckTailRequest, call=servicer.check_tail)})


def check_tail_request() -> jpb.CheckTailRequest:
    token = jpb.WriterToken(run_id="r" * 32, step_id="agent", last_seq=7)
    return jpb.CheckTailRequest(token=token)


async def _call(session: LocalSession, request: jpb.CheckTailRequest) -> jpb.CheckTailResponse:
    return await session.call(CHECK_TAIL, request, jpb.CheckTailResponse, {})


async def test_a_local_session_answers_in_order_and_copies_the_request() -> None:
    servicer = Servicer()
    session = local(servicer)
    request = check_tail_request()
    answer = await _call(session, request)
    assert isinstance(answer, jpb.CheckTailResponse)
    request.token.last_seq = 99  # the caller changes what it holds...
    assert servicer.seen[0].token.last_seq == 7  # ...and the servicer's copy stays
    assert servicer.seen[0] is not request
    assert not session.done()


async def test_a_domain_error_answers_its_call_and_the_session_goes_on() -> None:
    from dagnats.core import errors

    raised = errors.InvalidArgument("no such token", field="token")
    servicer = Servicer(raised)
    session = local(servicer)
    with pytest.raises(errors.InvalidArgument) as answered:
        await _call(session, check_tail_request())
    assert answered.value.field == "token" and "no such token" in answered.value.message
    assert answered.value is not raised, "a copy, as across the wire"
    assert not session.done()
    servicer.raises = None
    assert isinstance(await _call(session, check_tail_request()), jpb.CheckTailResponse)


async def test_an_unexpected_failure_ends_the_session_as_grpc_would() -> None:
    session = local(Servicer(RuntimeError("boom")))
    with pytest.raises(TransportError) as failed:
        await _call(session, check_tail_request())
    assert failed.value.code == grpc.StatusCode.UNKNOWN
    assert "boom" in failed.value.message
    assert session.done()
    with pytest.raises(TransportError):
        await _call(session, check_tail_request())


# ---- the command line ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["serve", "journal", "--handlers", "tests.handlers_app:HANDLERS"], "serve all"),
        (["serve", "gateway", "--handlers", "tests.handlers_app:HANDLERS"], "serve all"),
        (["serve", "all", "--handlers", "no-colon"], "module:attribute"),
        (["serve", "all", "--handlers", "tests.no_such_module:HANDLERS"], "cannot import"),
        (["serve", "all", "--handlers", "tests.handlers_app:MISSING"], "has no MISSING"),
        (["serve", "all", "--handlers", "tests.handlers_app:NOT_A_MAPPING"], "mapping"),
        (
            ["serve", "all", "--handler-concurrency=0", "--handlers=tests.handlers_app:HANDLERS"],
            "--handler-concurrency",
        ),
        # The journal's local socket (ADR 45, tests/test_local_socket.py).
        (["serve", "inputs", "--local-socket", "/tmp/x.sock"], "needs the journal"),
        (["serve", "gateway", "--local-socket", "/tmp/x.sock"], "needs the journal"),
    ],
)
def test_bad_serve_flags_are_one_line_before_anything_starts(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # No NATS runs here: a refusal that came after connecting would hang.
    assert main([*args, "--nats", "nats://127.0.0.1:1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


async def test_dagnats_dev_runs_handlers_in_its_process(tmp_path: Path) -> None:
    dev = await asyncio.to_thread(
        start_dev,
        tmp_path / "dev",
        "--no-demo",
        "--handlers",
        "tests.handlers_app:HANDLERS",
        stderr=tmp_path / "dev.err",
    )
    try:  # no worker runs but the handlers in the dev process
        await run_echo(dev.engine)
    finally:
        dev.proc.send_signal(signal.SIGINT)
        code = await asyncio.to_thread(dev.proc.wait, 30)
        dev.proc.communicate()
    assert code in (0, 130)
    assert "Traceback" not in (tmp_path / "dev.err").read_text()


async def run_echo(target: str, credentials: Credentials | None = None) -> None:
    """A two-iteration journaled run of ``tests.handlers_app``'s handler,
    with no worker but the handlers of the process at ``target``."""
    name = unique("hosted")
    async with Client(target, credentials=credentials) as client:
        await client.register_workflow(loop_workflow(name, "hosted-echo"))
        run = await client.start_run(name, {"say": "hi"})
        done = await client.wait_for_run(run.run_id, timeout=30)
    assert done.status == pb.RUN_STATUS_COMPLETED, done.error
    assert run_output(done) == {"echo": "hi", "iterations": 2}


def started(args: list[str], err: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``args`` from the repository's root, its stdout piped, stderr into ``err``."""
    with err.open("w") as stderr:  # the child keeps its own copy open
        return subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=Path(__file__).parent.parent,
            env=env,
        )


async def test_serve_all_runs_handlers_and_stops_in_order_on_sigterm(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    args = [sys.executable, "-m", "dagnats.cli.main", "serve", "all", "--nats", nats_server.url]
    args += ["--port", "0", "--handlers", "tests.handlers_app:HANDLERS"]
    err = tmp_path / "serve.err"
    proc = await asyncio.to_thread(started, args, err)
    assert proc.stdout is not None
    try:
        serving = await asyncio.to_thread(proc.stdout.readline)
        assert " serving on " in serving, serving + err.read_text()
        assert "hosted-echo" in await asyncio.to_thread(proc.stdout.readline)
        await run_echo(serving.split(" serving on ")[1].strip())
        proc.send_signal(signal.SIGTERM)  # as a stopped container is told
        code = await asyncio.to_thread(proc.wait, 30)
    finally:
        proc.kill()
        proc.communicate()
    assert code in (0, 130), err.read_text()
    assert "Traceback" not in err.read_text()


async def test_handlers_of_a_secured_server_need_none_of_the_operators_credentials(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """TLS and tokens on the port, and no ``DAGNATS_TOKEN`` or ``DAGNATS_TLS_*``
    for the process's own worker: it takes the server's own loopback port
    with a worker token minted in the process. Callers still need theirs."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "server.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    ours = ("DAGNATS_TOKEN", "DAGNATS_TLS", "DAGNATS_GRPC_")  # the suite's NATS settings stay
    env = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    env |= {
        "DAGNATS_GRPC_TLS_CERT": str(tmp_path / "server.pem"),
        "DAGNATS_GRPC_TLS_KEY": str(tmp_path / "server.key"),
        "DAGNATS_GRPC_WORKER_TOKENS": "operators-worker-token",
        "DAGNATS_GRPC_ADMIN_TOKENS": "operators-admin-token",
    }
    args = [sys.executable, "-m", "dagnats.cli.main", "serve", "all", "--nats", nats_server.url]
    args += ["--port", "0", "--handlers", "tests.handlers_app:HANDLERS"]
    err = tmp_path / "serve.err"
    proc = await asyncio.to_thread(started, args, err, env)
    assert proc.stdout is not None
    try:
        serving = await asyncio.to_thread(proc.stdout.readline)
        assert " serving on " in serving, serving + err.read_text()
        assert "hosted-echo" in await asyncio.to_thread(proc.stdout.readline)
        target = serving.split(" serving on ")[1].strip()
        caller = Credentials(token="operators-admin-token", ca=str(tmp_path / "ca.pem"))
        await run_echo(target, caller)
        async with Client(target, credentials=Credentials(ca=str(tmp_path / "ca.pem"))) as anon:
            with pytest.raises(errors.Unauthenticated):
                await anon.list_workflows()
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.communicate)
    assert "Traceback" not in err.read_text()
