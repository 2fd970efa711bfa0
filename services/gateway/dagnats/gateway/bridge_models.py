"""The JSON bodies of the worker bridge (``dagnats.gateway.bridge``).

Request bodies forbid unknown fields, so a typo is a 400 naming the field
instead of a silently ignored option. JSON payloads (inputs, outputs, states,
model responses, tool inputs and outputs) are any JSON value. Durations are a
number of seconds or a string such as ``"500ms"``, ``"30s"``, ``"2m"``, ``"1h"``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
)

from dagnats.core.durations import PATTERN, parse_duration
from dagnats.core.errors import InvalidArgument

# The engine holds a poll at most a minute.
MAX_POLL_WAIT = 60.0
INT32 = 2**31 - 1
UINT64 = 2**64 - 1


def parse_seconds(value: Any) -> float:
    """A duration (``dagnats.core.durations``) as seconds, for pydantic."""
    try:
        return parse_duration(value, field="duration")
    except InvalidArgument as err:
        raise ValueError(err.message.removeprefix("duration ")) from None


def _unicode(value: str) -> str:
    # JSON allows lone surrogates ("\ud800"); the contract's strings are UTF-8.
    try:
        value.encode()
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogates)") from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]
Position = Annotated[int, Field(ge=0, le=INT32)]
RecordSeq = Annotated[int, Field(ge=1, le=UINT64)]


Seconds = Annotated[
    float,
    BeforeValidator(parse_seconds),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "minimum": 0},
                {"type": "string", "pattern": PATTERN},
            ],
            "description": "seconds, or a string such as 500ms, 30s, 2m, 1h30m, 2d",
        }
    ),
]
Token = Annotated[
    str,
    Field(min_length=1, description="the task token; send the latest one the bridge returned"),
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- poll ---------------------------------------------------------------------------


class PollBody(_Body):
    task_types: list[Annotated[Text, Field(min_length=1, max_length=64)]] = Field(
        min_length=1, max_length=32, description="task types this worker handles"
    )
    max_tasks: int = Field(default=1, ge=1, le=256, description="most tasks to lease")
    wait: Seconds = Field(default=30.0, description="longest time to wait for a task (<= 60s)")
    worker_id: Text = Field(default="", max_length=128, description="names the worker in claims")
    restart_limit: int = Field(
        default=5,
        ge=1,
        le=1000,
        description="deliveries of one iteration in a row without progress that fail it",
    )
    build_id: Text = Field(
        default="",
        max_length=64,
        description=(
            "the build of the worker's code (A-Z, a-z, 0-9, '_' or '-'): its commits pin "
            "their steps to it, and its polls take those steps' tasks too; empty: unversioned"
        ),
    )


class TaskView(BaseModel):
    run_id: str
    step_id: str
    task_type: str
    iteration: int
    attempt: int
    workflow: str
    input: Any = Field(description="the step's input, any JSON value")
    trace_context: dict[str, str] = {}
    settings: dict[str, str] = Field(
        default={}, description="the run's settings its handler reads, such as which model"
    )


class LeasedTaskView(BaseModel):
    task: TaskView
    token: str
    delivery: int = Field(description="how many times this task was delivered, from 1")
    lease_seconds: float = Field(description="heartbeat within this time to keep the task")


class PollResult(BaseModel):
    tasks: list[LeasedTaskView]


# ---- token-only calls -----------------------------------------------------------------


class TokenBody(_Body):
    token: Token


class TokenResult(BaseModel):
    token: str


# ---- the journal ----------------------------------------------------------------------


class ReadResult(BaseModel):
    token: str
    records: list[dict[str, Any]] = Field(
        description="this iteration's records (every attempt) up to this holder's last write"
    )
    state: Any = Field(description="the state the claim loaded (or saved since), or null")
    has_state: bool


class ModelBeginResult(BaseModel):
    token: str
    position: int
    recorded: bool = Field(description="true: use `response`; false: ask the model, then record")
    response: Any = None


class UsageBody(_Body):
    """What a model call spent, as the provider reported it."""

    input_tokens: int = Field(default=0, ge=0, description="tokens read, cached ones included")
    output_tokens: int = Field(default=0, ge=0, description="tokens written")
    cached_tokens: int = Field(default=0, ge=0, description="of input_tokens, read from a cache")
    model: str = Field(default="", max_length=256, description="the model that answered")


class ModelRecordBody(_Body):
    token: Token
    response: Any = Field(description="the model's response, any JSON value")
    usage: UsageBody | None = Field(
        default=None, description="what the call spent (the run's usage ledger)"
    )


class ToolBeginBody(_Body):
    token: Token
    name: Text = Field(min_length=1, max_length=256)
    input: Any = None
    replay: Literal["safe", "unsafe"] = Field(
        default="unsafe", description="safe: running it twice is harmless"
    )


class ToolResultView(BaseModel):
    output: Any = None
    error: str = ""
    interrupted: bool = Field(
        default=False, description="an earlier holder started the call and did not finish it"
    )
    partial: str = Field(default="", description="output that holder reported")


class ToolBeginResult(BaseModel):
    token: str
    position: int
    key: str = Field(description="{run}.{step}.{iteration}.{position}: an idempotency key")
    run: bool = Field(description="true: run the tool, then finish it; false: use `result`")
    intent_seq: int
    result: ToolResultView | None = None


class ToolsCall(BaseModel):
    """One call of a parallel group, as the model's response asked for it."""

    name: Text = Field(min_length=1, max_length=256)
    input: Any = None
    replay: Literal["safe", "unsafe"] = Field(
        default="unsafe", description="safe: running it twice is harmless"
    )


class ToolsBeginBody(_Body):
    token: Token
    calls: list[ToolsCall] = Field(
        min_length=1, max_length=128, description="the calls, in the model response's order"
    )


class ToolsBeginCall(BaseModel):
    position: int
    key: str = Field(description="{run}.{step}.{iteration}.{position}: an idempotency key")
    run: bool = Field(description="true: run the tool, then finish it; false: use `result`")
    intent_seq: int
    intent_index: int = Field(description="the intent's index in its record (with intent_seq)")
    result: ToolResultView | None = None


class ToolsBeginResult(BaseModel):
    token: str
    position: int = Field(description="position of the group's first call")
    calls: list[ToolsBeginCall] = Field(description="one answer per call, in the request's order")


class ToolsResult(BaseModel):
    """The result of one call of a parallel group."""

    intent_seq: RecordSeq
    intent_index: int = Field(default=0, ge=0, le=127)
    output: Any = None
    error: Text = Field(default="", description="the tool's own error; part of its result")


class ToolsFinishBody(_Body):
    token: Token
    results: list[ToolsResult] = Field(
        min_length=1, max_length=128, description="results of calls that finished, in any order"
    )


class ToolOutputBody(_Body):
    token: Token
    chunk: Text
    intent_seq: RecordSeq | None = Field(default=None, description="default: the begun tool call")
    intent_index: int = Field(default=0, ge=0, le=127, description="a parallel group's call")


class ToolFinishBody(_Body):
    token: Token
    output: Any = None
    error: Text = Field(default="", description="the tool's own error; part of its result")
    interrupted: bool = Field(
        default=False,
        description="the tool was stopped before it finished (its run was cancelled); "
        "no output or error, `partial` says what it reported",
    )
    partial: Text = Field(default="", description="with `interrupted`: the output it reported")
    intent_seq: RecordSeq | None = Field(default=None, description="default: the begun tool call")
    intent_index: int = Field(default=0, ge=0, le=127, description="a parallel group's call")


class PlaceInputsBody(_Body):
    token: Token
    mode: Literal["steer", "follow_up"] = "steer"


class PlacedInputView(BaseModel):
    request_id: str
    mode: Literal["steer", "follow_up"]
    content: Any = None
    carried: bool = False


class PlaceInputsResult(BaseModel):
    token: str
    inputs: list[PlacedInputView]


class ModelRecord(_Body):
    kind: Literal["model"]
    position: Position | None = Field(default=None, description="default: the next position")
    response: Any
    usage: UsageBody | None = Field(
        default=None, description="what the call spent (the run's usage ledger)"
    )


class ToolIntentRecord(_Body):
    kind: Literal["tool_intent"]
    position: Position | None = Field(default=None, description="default: the next position")
    name: Text = Field(min_length=1, max_length=256)
    input: Any = None
    replay: Literal["safe", "unsafe"] = "unsafe"


class ToolOutputRecord(_Body):
    kind: Literal["tool_output"]
    intent_seq: int | None = None
    chunk: Text


class ToolResultRecord(_Body):
    kind: Literal["tool_result"]
    intent_seq: RecordSeq | None = None
    output: Any = None
    error: Text = ""


class AppendBody(_Body):
    token: Token
    record: ModelRecord | ToolIntentRecord | ToolOutputRecord | ToolResultRecord = Field(
        discriminator="kind"
    )


class AppendResult(BaseModel):
    token: str
    kind: str
    seq: int = Field(description="sequence of the record written; 0 when nothing was written")
    position: int | None = None
    recorded: bool | None = Field(
        default=None, description="model: a response was already recorded (it is `response`)"
    )
    response: Any = None
    run: bool | None = Field(default=None, description="tool_intent: run the tool now")
    intent_seq: int | None = None
    result: ToolResultView | None = None


# ---- checkpoints and resolve ------------------------------------------------------------


class CheckpointSaveBody(_Body):
    token: Token
    state: Any = Field(description="any JSON value")


class CheckpointSaveResult(BaseModel):
    token: str
    journaled: bool = Field(
        description="true: the state rides the task's commit (keep the returned token)"
    )


class CheckpointLoadResult(BaseModel):
    state: Any = None
    source: Literal["journal", "checkpoint", "none"]


class WaitBody(_Body):
    delay: Seconds | None = None
    until: AwareDatetime | None = None
    until_input: bool = False


class ResolveBody(_Body):
    token: Token
    outcome: Literal["continue", "complete", "fail", "fail_permanent", "pause"]
    output: Any = Field(default=None, description="continue, complete: any JSON value")
    error: Text = Field(default="", max_length=64 << 10, description="fail: what went wrong")
    reason: Text = Field(default="", max_length=256, description="fail: a machine-readable reason")
    state: Any = Field(
        default=None, description="journaled: the state to commit (omit to keep the current one)"
    )
    wait: WaitBody | None = Field(default=None, description="continue: wait before the next turn")
    pause: Seconds | None = Field(default=None, description="pause: run this iteration again after")


class ResolveResult(BaseModel):
    outcome: str
    journal_seq: int = Field(description="the commit behind the outcome; 0 without a journal")
