"""Every ``DAGNATS_*`` setting in one table: its variables, default and meaning.

The settings are read where they are used (``dagnats.engine.config``,
``dagnats.gateway.config``, ``dagnats.core.natsauth``, the SDK, the CLI); this
table is what the documentation's settings reference is generated from, and
``tests/test_docs.py`` fails when a variable the code reads is missing here or
one listed here is no longer read. The engine's settings take their defaults
from ``EngineConfig`` itself when the reference is built.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GENERAL", "NATS", "SECURITY", "SETTINGS", "TIMING", "TOPICS", "Setting"]

GENERAL = "Processes, addresses and models"
SECURITY = "TLS and tokens"
NATS = "NATS credentials and TLS"
TIMING = "Timing and limits"
TOPICS = (GENERAL, SECURITY, NATS, TIMING)


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting: the variables that make it (a pair, say), its default and
    what it means (Markdown)."""

    topic: str
    names: tuple[str, ...]
    default: str
    meaning: str


SETTINGS: tuple[Setting, ...] = (
    Setting(
        GENERAL,
        ("DAGNATS_ENGINE",),
        "127.0.0.1:7233",
        "engine address for the CLI (else the one in `dev.json` of the data directory)",
    ),
    Setting(
        GENERAL,
        ("DAGNATS_DATA_DIR",),
        ".dagnats",
        "data directory of `dagnats dev`, where the CLI looks for `dev.json` (`--data-dir`)",
    ),
    Setting(
        GENERAL,
        ("DAGNATS_NATS_URL",),
        "nats://127.0.0.1:4222",
        "NATS for `dagnats serve`",
    ),
    Setting(
        GENERAL,
        ("DAGNATS_JOURNAL", "DAGNATS_INPUTS"),
        "unset",
        "`dagnats serve gateway`: the journal and inputs services' addresses when they "
        "run apart from the engine (`--journal`, `--inputs`)",
    ),
    Setting(
        GENERAL,
        ("DAGNATS_METRICS_PORT",),
        "unset",
        "`dagnats serve engine`, `journal` or `all`: serve the services' counters for "
        "Prometheus on this port (`--metrics-port`)",
    ),
    Setting(
        GENERAL,
        ("DAGNATS_BUILD_ID",),
        "unset",
        "The SDK's `Worker`: the build of the worker's code (`Worker(build_id=...)`), one "
        "token of at most 64 characters; a step's first commit records it, and under the "
        "workflow's `pinned` policy the step's later dispatches go only to workers of that "
        "build. Unset: an unversioned worker, which takes only unpinned tasks",
    ),
    Setting(
        GENERAL,
        ("DAGNATS_LOCAL_SOCKET",),
        "unset",
        "`dagnats serve journal` or `all`: also take the journal's calls (with the "
        "engine, its polls and watches too) on a Unix socket at this path "
        "(`--local-socket`). The SDK's `Worker`: put its journal calls on the services' "
        "local socket at this path (`Worker(local_socket=...)`); `off`: every call on "
        "gRPC; unset: on the socket the polls' answers name when it is on this host, else "
        "gRPC",
    ),
    Setting(
        GENERAL,
        ("DAGNATS_REPLICAS",),
        "1",
        "stream replicas (3 on a production cluster)",
    ),
    Setting(
        GENERAL,
        ("DAGNATS_PARTITIONS",),
        "1",
        "number of partitions the runs are split into among the replicas (1 to 64; "
        "`dagnats serve --partitions`): recorded by the first process to provision, "
        "fixed after; a process given a different number refuses to start. Unset, a "
        "process takes the recorded number",
    ),
    Setting(
        GENERAL,
        ("DAGNATS_REPLICA_ID",),
        "random",
        "this replica's id in the `PARTITIONS` bucket (letters, digits, `_`, `-`; "
        "`dagnats serve --replica-id`); each process that serves the engine is a replica",
    ),
    Setting(
        TIMING,
        ("DAGNATS_PARTITION_LEASE",),
        "5",
        "the partition lease, whole seconds (at least 1): a replica that stops renewing "
        "its presence (killed, frozen, cut off) loses its partitions to the others this "
        "long after; one stopped with SIGTERM hands them over at once",
    ),
    Setting(
        TIMING,
        ("DAGNATS_LOOP_STATE_MAX_BYTES",),
        "1048576",
        "largest checkpoint of a non-journal step",
    ),
    Setting(
        SECURITY,
        ("DAGNATS_API_TOKEN",),
        "unset",
        "bearer token of the HTTP API (runs, inputs, journal); unset: loopback only",
    ),
    Setting(
        SECURITY,
        ("DAGNATS_BRIDGE_TOKEN",),
        "unset",
        "bearer token of the worker bridge; unset: loopback only",
    ),
    Setting(
        SECURITY,
        ("DAGNATS_GRPC_TLS_CERT", "DAGNATS_GRPC_TLS_KEY"),
        "unset",
        "`dagnats serve`: PEM certificate chain and key; gRPC over TLS",
    ),
    Setting(
        SECURITY,
        ("DAGNATS_GRPC_CLIENT_CA",),
        "unset",
        "PEM CA bundle: every client must present a certificate it signed (mTLS)",
    ),
    Setting(
        SECURITY,
        ("DAGNATS_GRPC_CERT_ROLES",),
        "unset",
        "mTLS: certificate names (subject CN or SAN) and their roles, "
        "`worker.example=worker,ops.example=admin`",
    ),
    Setting(
        SECURITY,
        ("DAGNATS_GRPC_TOKENS_FILE",),
        "unset",
        "bearer tokens, one `<worker\\|client\\|admin> <token>` a line; read again when it "
        "changes (revoke by removing the line)",
    ),
    Setting(
        SECURITY,
        ("DAGNATS_GRPC_WORKER_TOKENS", "DAGNATS_GRPC_CLIENT_TOKENS", "DAGNATS_GRPC_ADMIN_TOKENS"),
        "unset",
        "fixed bearer tokens of each role, comma-separated (valid until a restart)",
    ),
    Setting(
        SECURITY,
        ("DAGNATS_TOKEN",),
        "unset",
        "the token the SDK, the CLI and the Node worker send to the engine",
    ),
    Setting(
        TIMING,
        ("DAGNATS_GRPC_KEEPALIVE",),
        "20",
        "SDK and CLI: seconds of silence before a connection with calls open is pinged; "
        "an unanswered ping breaks it, so a watch or session on a frozen engine is "
        "retried, then fails `Unavailable`, instead of hanging",
    ),
    Setting(
        TIMING,
        ("DAGNATS_LOCAL_KEEPALIVE",),
        "10",
        "SDK: seconds within which a call on the services' local socket that nothing "
        "answers, not even a ping, ends; a watch or long poll on a frozen services process "
        "is then tried again as on a broken connection (a ping is sent only while a call "
        "waits with nothing arriving)",
    ),
    Setting(
        GENERAL,
        ("DAGNATS_GRPC_BALANCE",),
        "off",
        "SDK, CLI and gateway: spread calls over every address the target names (a "
        "list `ipv4:a:7233,b:7233`, or a DNS name with one address per replica, "
        "`dns:///dagnats:7233`) in turn, instead of using the first that answers",
    ),
    Setting(
        SECURITY,
        ("DAGNATS_TLS_CA",),
        "unset",
        "PEM CA of the engine's certificate: connect with TLS (CLI: `--tls-ca`)",
    ),
    Setting(
        SECURITY,
        ("DAGNATS_TLS_CERT", "DAGNATS_TLS_KEY"),
        "unset",
        "client certificate and key, for an engine that requires mTLS (`--tls-cert`, `--tls-key`)",
    ),
    Setting(
        SECURITY,
        ("DAGNATS_TLS",),
        "false",
        "connect with TLS trusting the system's roots, when there is no `DAGNATS_TLS_CA`",
    ),
    Setting(
        SECURITY,
        ("DAGNATS_GATEWAY_CLIENT_TOKEN",),
        "unset",
        "the gateway's token towards the engine for its REST API (client role; admin to "
        "register workflows or purge runs through it)",
    ),
    Setting(
        SECURITY,
        ("DAGNATS_GATEWAY_TLS_CERT", "DAGNATS_GATEWAY_TLS_KEY"),
        "unset",
        "the gateway's HTTPS certificate chain and key (PEM files, both or neither); "
        "unset: plain HTTP, with a warning off loopback (end TLS in front of it then)",
    ),
    Setting(
        SECURITY,
        ("DAGNATS_GATEWAY_WORKER_TOKEN",),
        "unset",
        "the gateway's token towards the engine for the worker bridge (worker role)",
    ),
    Setting(
        NATS,
        ("DAGNATS_NATS_USER",),
        "unset",
        "NATS user, with a password (`--nats-user`)",
    ),
    Setting(
        NATS,
        ("DAGNATS_NATS_PASSWORD",),
        "unset",
        "that user's password",
    ),
    Setting(
        NATS,
        ("DAGNATS_NATS_PASSWORD_FILE",),
        "unset",
        "a file holding the password instead (`--nats-password-file`)",
    ),
    Setting(
        NATS,
        ("DAGNATS_NATS_TOKEN",),
        "unset",
        "a NATS token",
    ),
    Setting(
        NATS,
        ("DAGNATS_NATS_TOKEN_FILE",),
        "unset",
        "a file holding the token instead (`--nats-token-file`)",
    ),
    Setting(
        NATS,
        ("DAGNATS_NATS_NKEY",),
        "unset",
        "a file holding an nkey user seed (`--nats-nkey`)",
    ),
    Setting(
        NATS,
        ("DAGNATS_NATS_CREDS",),
        "unset",
        "a NATS creds file: a user JWT and its seed (`--nats-creds`)",
    ),
    Setting(
        NATS,
        ("DAGNATS_NATS_CA",),
        "unset",
        "the CA that signed nats-server's certificate; turns TLS on (`--nats-ca`)",
    ),
    Setting(
        NATS,
        ("DAGNATS_NATS_CERT",),
        "unset",
        "client certificate for mTLS to nats-server, with `DAGNATS_NATS_KEY` (`--nats-cert`)",
    ),
    Setting(
        NATS,
        ("DAGNATS_NATS_KEY",),
        "unset",
        "its key (`--nats-key`)",
    ),
    Setting(
        TIMING,
        ("DAGNATS_TASK_ACK_WAIT",),
        "30",
        "a task's lease: a worker that neither heartbeats nor reports within it loses the "
        "task to a redelivery",
    ),
    Setting(
        TIMING,
        ("DAGNATS_HISTORY_ACK_WAIT",),
        "30",
        "how long an engine may take to apply one lifecycle event before another engine "
        "is given it",
    ),
    Setting(
        TIMING,
        ("DAGNATS_TIMER_ACK_WAIT",),
        "30",
        "the same for a timer that fired",
    ),
    Setting(
        TIMING,
        ("DAGNATS_RECONCILE_INTERVAL",),
        "10",
        "how often an engine looks for stranded work: an unpublished outbox, a vanished "
        "task, an event an engine took and never applied (it died); such an event is "
        "applied within about two intervals instead of after `DAGNATS_HISTORY_ACK_WAIT`. "
        "A pass reads only the runs in motion (those written since the last pass, then "
        "the index of active runs): a run parked for an input or a timer (nothing to "
        "publish, no task in flight) leaves its index, costs no pass anything, and an "
        "event an engine took for it and never applied waits out "
        "`DAGNATS_HISTORY_ACK_WAIT`",
    ),
    Setting(
        TIMING,
        ("DAGNATS_OUTBOX_GRACE",),
        "5",
        "how old a running run's outbox must be before the reconciler publishes it (unless "
        "this engine did) and clears it; the engine's own writes leave it for the run's next "
        "write to replace. An ended run's is published by the pass that reads its end, "
        "unless its engine did, and never cleared",
    ),
    Setting(
        TIMING,
        ("DAGNATS_CLOCK_SKEW",),
        "5",
        "the most an engine's clock may be ahead of nats-server's: a run list reads back "
        "from the newest runs by creation time until what is left was stored this long "
        "before its page's oldest run was created",
    ),
    Setting(
        TIMING,
        ("DAGNATS_NATS_RETRY",),
        "30",
        "how long a service retries a transient JetStream error (a stream electing its "
        "leader, no responders, a timeout where repeating is safe) inside one request; "
        "never past the request's own deadline",
    ),
    Setting(
        TIMING,
        ("DAGNATS_NATS_ATTEMPT_TIMEOUT",),
        "5",
        "how long one try of a journal append waits for JetStream's answer before it is "
        "sent again (same Msg-Id), within `DAGNATS_NATS_RETRY`",
    ),
    Setting(
        TIMING,
        ("DAGNATS_GATEWAY_RETRY_FOR",),
        "10",
        "how long one HTTP request rides out an engine the gateway cannot reach before it "
        "answers 503 with `Retry-After: 1`",
    ),
    Setting(
        TIMING,
        ("DAGNATS_GATEWAY_KEEP_ALIVE",),
        "120",
        "how long the gateway keeps an idle HTTP connection open (said in a `Keep-Alive: "
        "timeout=` header): longer than clients keep one for reuse (httpx 5 s, Node's "
        "`fetch` 4 s, Go 90 s), so a client never sends a request over a connection the "
        "gateway is closing. Behind a proxy or load balancer, set it above the proxy's "
        "idle timeout",
    ),
    Setting(
        TIMING,
        ("DAGNATS_SETTLE_GRACE",),
        "10",
        "how long a stopping journal service waits to settle the tasks of commits it "
        "already answered",
    ),
    Setting(
        TIMING,
        ("DAGNATS_EVENT_WAIT",),
        "3",
        "the commit wait: how long the journal service waits for the engine's decision "
        "on a stored commit's event. A commit that keeps its task is answered without "
        "the next dispatch when none came in time; its task then waits out its lease and "
        "is delivered carrying what the run says. The first third waits for an engine "
        "that took the commit's event (the engine of the same process when `serve all` "
        "runs one, else one over core NATS); then the event is published on the history "
        "and the rest waits for the engine that applies it. A commit that releases its "
        "task sends its event the same way, and publishes it on the history when no "
        "engine answered within that first third",
    ),
    Setting(
        TIMING,
        ("DAGNATS_HISTORY_BATCH",),
        "64",
        "most events one fetch takes from the history (a count); also the most held "
        "commits' events an engine applies at once",
    ),
    Setting(
        TIMING,
        ("DAGNATS_DEAD_LETTER_AFTER",),
        "10",
        "deliveries of a failing event before it is moved to the dead letters (a count)",
    ),
    Setting(
        TIMING,
        ("DAGNATS_STATE_MAX_BYTES",),
        "268435456",
        "largest state a journaled step may save (256 MiB): a commit of a larger one fails "
        "the step at once with the state's size; the SDK and the journal service both read it",
    ),
    Setting(
        TIMING,
        ("DAGNATS_STATE_SNAPSHOT_EVERY",),
        "64",
        "a journaled step's commit stores its whole state (a snapshot) after this many "
        "commits that stored only what their turn changed (deltas); the SDK reads it",
    ),
    Setting(
        TIMING,
        ("DAGNATS_STATE_SNAPSHOT_BYTES",),
        "1048576",
        "... or once the deltas since the last snapshot add up to this many bytes, while "
        "the state fits one journal record (past it the chain goes on in deltas)",
    ),
    Setting(
        TIMING,
        ("DAGNATS_STATE_HELD_BYTES",),
        "268435456",
        "bytes of large states (over 1.5 MiB) a worker process holds for steps whose task "
        "went back to the queue, so the dispatch that comes back reads nothing",
    ),
    Setting(
        TIMING,
        ("DAGNATS_KEPT_WRITE_BATCH",),
        "16",
        "most iterations of a journaled loop on a kept task decided before the run is "
        "written; `1` writes it every iteration (a count)",
    ),
    Setting(
        TIMING,
        ("DAGNATS_KEPT_WRITE_DELAY",),
        "0.2",
        "longest such iterations wait for the run's write: how far `GetRun`, `WatchRun` "
        "and the console may be behind the journal (seconds)",
    ),
    Setting(
        TIMING,
        ("DAGNATS_RUN_RETENTION",),
        "`2592000` (30 days)",
        "how long an ended run is kept after its end; then the engine purges it and "
        "everything of it (journal, inputs, history, checkpoints, idempotency key) by a "
        "durable timer set when it ended. Nothing of a running run expires, however long "
        "it waits",
    ),
    Setting(
        TIMING,
        ("DAGNATS_INPUT_DEDUPE_WINDOW",),
        "`604800` (7 days)",
        "how long a repeat of an input's `request_id` is promised the original, and how "
        "long an input may wait queued: one queued longer ends `expired` and is never "
        "placed",
    ),
    Setting(
        GENERAL,
        ("DAGNATS_NATS_MONITOR",),
        "unset",
        "`dagnats serve`: nats-server's monitoring URL, to check `sync_interval` at "
        "start-up (`--nats-monitor`)",
    ),
    Setting(
        GENERAL,
        ("DAGNATS_MODEL",),
        "unset",
        "the model of `dagnats dev`'s demo, of `dagnats.sdk.models.model_from_env()` and "
        "of `dagnats.integrations.pydantic_ai.model_from_env()`: `provider:model` or "
        "`provider:model@base-url` (`openai:gpt-4.1-mini` with `OPENAI_API_KEY`, "
        "`anthropic:claude-sonnet-4-5` with `ANTHROPIC_API_KEY`); unset: a stand-in",
    ),
    Setting(
        GENERAL,
        ("DAGNATS_PRICES",),
        "unset",
        "the journal service's price table, which prices each model call it records (the "
        "usage ledger, budgets by cost): a JSON object mapping a model's name to its prices "
        'per million tokens, `{"gpt-4.1-mini": {"input": 0.4, "output": 1.6, '
        '"cached": 0.1}}` (`cached`: cached input tokens, `input` when left out), in '
        "one currency of your choice. A model named with a date suffix takes its longest "
        "listed prefix's price; an unlisted model records no cost. A table that does not "
        "parse stops the service at its start",
    ),
)
