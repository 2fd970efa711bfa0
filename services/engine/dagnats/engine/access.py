"""Who may call what on the engine's gRPC port: the rules, apart from gRPC.

Every rule of access control is in this module; ``dagnats.engine.security``
only moves credentials from a call into it and its decision back out.

Invariants:

- Every method of the three services on the port has exactly one entry in
  ``METHOD_ROLES``; a method missing from it is refused to everyone but
  admin (a test walks the services' descriptors, so a new RPC cannot be
  forgotten silently).
- Health checking is open; server reflection is admin's.
- A worker may list a step's inputs (is anything queued?) but is answered
  without their content, which it gets only by placing them in its journal.
- A call with no credential, or with one that matches nothing, is
  ``UNAUTHENTICATED``; a credential whose roles do not include the method's
  is ``PERMISSION_DENIED``.
- Roles: *worker* runs tasks (poll, heartbeat, report, checkpoints, the
  journal calls of a task it holds: the journal's writer token and the
  engine's lease scope which task); *client* controls runs and reads them
  (runs, inputs, journal reads and the audit); *admin* is a client that
  also registers workflows and purges runs. Admin implies client, not
  worker: an operator's credential never writes a journal.
- Tokens are compared in constant time, each against every configured one,
  so how long a lookup takes says nothing about which token came close.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from dagnats.core.credentials import check_bearer_token
from dagnats.core.errors import InvalidArgument


class Role(enum.StrEnum):
    """What a credential may do."""

    WORKER = "worker"
    CLIENT = "client"
    ADMIN = "admin"


class Decision(enum.Enum):
    """The answer to one call."""

    ALLOW = "allow"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"


_ENGINE = "/dagnats.engine.v1.EngineService/"
_JOURNAL = "/dagnats.journal.v1.JournalService/"
_INPUTS = "/dagnats.inputs.v1.InputsService/"

# Open to anyone who can connect: load balancers and orchestrators probe it.
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = (
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)

_ROLE_NAMES = frozenset(r.value for r in Role)
_W, _C, _A = Role.WORKER, Role.CLIENT, Role.ADMIN

# Method -> the role it needs. Admin holds client's rights too (``roles_held``).
METHOD_ROLES: Mapping[str, Role] = {
    # Workflows: registering one is admin's; reading them is any client's.
    _ENGINE + "RegisterWorkflow": _A,
    _ENGINE + "GetWorkflow": _C,
    _ENGINE + "ListWorkflows": _C,
    # Runs.
    _ENGINE + "StartRun": _C,
    _ENGINE + "GetRun": _C,
    _ENGINE + "ListRuns": _C,
    _ENGINE + "WatchRun": _C,
    _ENGINE + "WatchRuns": _C,
    _ENGINE + "CancelRun": _C,
    _ENGINE + "ForkRun": _C,
    _ENGINE + "PurgeRun": _A,
    _ENGINE + "UpgradeRun": _A,
    # The task API.
    _ENGINE + "PollTasks": _W,
    _ENGINE + "Heartbeat": _W,
    _ENGINE + "Report": _W,
    _ENGINE + "LoadCheckpoint": _W,
    _ENGINE + "SaveCheckpoint": _W,
    # The journal's writer, for the task a worker holds.
    _JOURNAL + "Claim": _W,
    _JOURNAL + "BeginModel": _W,
    _JOURNAL + "RecordModel": _W,
    _JOURNAL + "RecordSpent": _W,
    _JOURNAL + "BeginTool": _W,
    _JOURNAL + "BeginTools": _W,
    _JOURNAL + "ToolOutput": _W,
    _JOURNAL + "FinishTool": _W,
    _JOURNAL + "CheckTail": _W,
    _JOURNAL + "PlaceInputs": _W,
    _JOURNAL + "Commit": _W,
    _JOURNAL + "Session": _W,
    _JOURNAL + "PutStream": _W,
    # The journal's readers and its audit.
    _JOURNAL + "Read": _C,
    _JOURNAL + "Check": _C,
    _JOURNAL + "ReadState": _C,
    _JOURNAL + "WatchStream": _C,
    # Inputs: a prompt-injection path, so run control's rights.
    _INPUTS + "Submit": _C,
    _INPUTS + "Get": _C,
    _INPUTS + "Withdraw": _C,
    _INPUTS + "List": _C,
}

# Calls a worker makes besides its own role's, answered without what only a
# client may read (``redacted_for``): whether inputs are queued for the step
# it holds, before it waits for one (``continue_(until_input=True)``). An
# input's content reaches a worker only through PlaceInputs, recorded in the
# journal under the writer token of the task it holds. And the state at a
# commit (the state chain), which a claim whose answer could not hold the state
# leaves to ReadState: a claim answers a worker the same state.
WORKER_ALSO: frozenset[str] = frozenset({_INPUTS + "List", _JOURNAL + "ReadState"})


def roles_held(roles: Iterable[Role]) -> frozenset[Role]:
    """The roles ``roles`` amount to: admin holds client's rights as well."""
    held = set(roles)
    if Role.ADMIN in held:
        held.add(Role.CLIENT)
    return frozenset(held)


def decide(method: str, roles: frozenset[Role] | None) -> Decision:
    """Whether a call of ``method`` by a caller holding ``roles`` may proceed.

    Args:
        method: The full method name, ``/package.Service/Method``.
        roles: The roles of the caller's credentials; None when it presented
            none that is valid.
    """
    if method.startswith(HEALTH_PREFIX):
        return Decision.ALLOW
    if roles is None:
        return Decision.UNAUTHENTICATED
    held = roles_held(roles)
    if method.startswith(REFLECTION_PREFIXES):
        return Decision.ALLOW if Role.ADMIN in held else Decision.PERMISSION_DENIED
    needed = METHOD_ROLES.get(method, Role.ADMIN)
    if needed in held or (Role.WORKER in held and method in WORKER_ALSO):
        return Decision.ALLOW
    return Decision.PERMISSION_DENIED


def redacted_for(method: str, roles: frozenset[Role]) -> bool:
    """Whether the answer to ``method`` leaves out what only a client may
    read: a call a worker may make beside its role's, made without client rights."""
    return method in WORKER_ALSO and Role.CLIENT not in roles_held(roles)


def method_name(method: str) -> str:
    """``/pkg.Service/Method`` as ``Service.Method``, for messages."""
    service, _, name = method.strip("/").partition("/")
    return f"{service.rsplit('.', 1)[-1]}.{name}"


@dataclass(frozen=True, slots=True)
class TokenTable:
    """The bearer tokens that are valid now, each with its role.

    Several tokens of one role may be valid at once, so a token can be
    rotated: add the new one, move the callers, remove the old one.
    """

    entries: tuple[tuple[bytes, Role], ...] = ()

    def __len__(self) -> int:
        return len(self.entries)

    def roles_of(self, token: str) -> frozenset[Role] | None:
        """The roles ``token`` carries; None when it is not a valid token.

        Compares against every entry, each in constant time.
        """
        given = token.encode("utf-8", "surrogateescape")
        found = set()
        for known, role in self.entries:
            if hmac.compare_digest(given, known):
                found.add(role)
        return frozenset(found) or None

    def merged(self, other: TokenTable) -> TokenTable:
        return TokenTable(self.entries + other.entries)


def tokens_of(role: Role, values: Iterable[str], *, source: str = "tokens") -> TokenTable:
    """A table of ``values`` (empty ones ignored, spaces around one taken
    off), all of ``role``.

    Raises:
        InvalidArgument: a value that is not a bearer token (a control
            character in it), naming ``source``.
    """
    tokens = [check_bearer_token(t, source=source) for t in (x.strip(" ") for x in values) if t]
    return TokenTable(tuple((t.encode(), role) for t in tokens))


def parse_tokens(text: str, *, source: str) -> TokenTable:
    """Parse a tokens file: one ``<role> <token>`` per line; ``#`` starts a
    comment, blank lines are ignored.

    Raises:
        InvalidArgument: a line with an unknown role or without a token, naming
            ``source`` and the line number (never the token).
    """
    entries: list[tuple[bytes, Role]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        role_name, _, token = line.partition(" ")
        token = token.strip()
        if role_name not in _ROLE_NAMES or not token or " " in token:
            raise InvalidArgument(
                f"{source}:{number}: expected '<worker|client|admin> <token>'", field=source
            )
        check_bearer_token(token, source=f"{source}:{number}")
        entries.append((token.encode(), Role(role_name)))
    return TokenTable(tuple(entries))


@dataclass(frozen=True, slots=True)
class IdentityMap:
    """Client-certificate identities (a subject common name or a subject
    alternative name) and the role each one is given under mTLS."""

    roles: Mapping[str, frozenset[Role]] = field(default_factory=dict)

    def roles_of(self, names: Iterable[str]) -> frozenset[Role] | None:
        """The roles of a certificate that names ``names``; None for none."""
        found: set[Role] = set()
        for name in names:
            found |= self.roles.get(name, frozenset())
        return frozenset(found) or None


def parse_identities(text: str, *, source: str) -> IdentityMap:
    """Parse ``name=role,name=role``: which certificate identity has which role.

    Raises:
        InvalidArgument: an entry without ``=`` or with an unknown role.
    """
    roles: dict[str, set[Role]] = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        name, _, role_name = entry.rpartition("=")
        if not name or role_name not in _ROLE_NAMES:
            raise InvalidArgument(
                f"{source}: expected 'name=<worker|client|admin>' entries, got {entry!r}",
                field=source,
            )
        roles.setdefault(name.strip(), set()).add(Role(role_name))
    return IdentityMap({k: frozenset(v) for k, v in roles.items()})


def missing_for_open_host(*, tls: bool, authenticated: bool) -> list[str]:
    """What a server on a non-loopback address lacks: the settings to set.

    Both TLS and authentication are needed: tokens over plaintext can be read
    off the network, and TLS alone lets anyone call.
    """
    missing = []
    if not tls:
        missing.append("DAGNATS_GRPC_TLS_CERT and DAGNATS_GRPC_TLS_KEY (TLS)")
    if not authenticated:
        missing.append(
            "DAGNATS_GRPC_TOKENS_FILE, DAGNATS_GRPC_*_TOKENS or DAGNATS_GRPC_CLIENT_CA "
            "with DAGNATS_GRPC_CERT_ROLES (authentication)"
        )
    return missing
