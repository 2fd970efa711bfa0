"""The usage ledger's rules (``dagnats.journal.ledger``) and the usage values
(``dagnats.core.usage``): each model call charged once as kept, retried or
fenced; a budget's decision; prices; budget raises. Pure: no event loop."""

from __future__ import annotations

import json

import pytest

from dagnats.core.errors import InvalidArgument
from dagnats.core.usage import (
    Budget,
    Policy,
    Price,
    Raise,
    Totals,
    Usage,
    parse_budget,
    parse_prices,
    parse_raise,
    price,
)
from dagnats.journal import ledger
from dagnats.journal.model import (
    Action,
    AnyEntry,
    ClaimEntry,
    CommitEntry,
    ForkEntry,
    InputEntry,
    ModelEntry,
)
from dagnats.journal.usage import StepLedger

U = Usage(input_tokens=100, output_tokens=20, cached_tokens=40, model="m", cost_micros=7)
seq = iter(range(1, 10_000))


def claim(iteration: int, attempt: int, writer: str = "w") -> ClaimEntry:
    return ClaimEntry(seq=next(seq), iteration=iteration, attempt=attempt, writer=writer)


def model(
    iteration: int,
    attempt: int,
    position: int,
    writer: str = "w",
    usage: Usage | None = U,
) -> ModelEntry:
    return ModelEntry(
        seq=next(seq),
        iteration=iteration,
        attempt=attempt,
        writer=writer,
        position=position,
        response=b"{}",
        usage=usage,
    )


def commit(iteration: int, attempt: int, action: Action, writer: str = "w") -> CommitEntry:
    return CommitEntry(
        seq=next(seq), iteration=iteration, attempt=attempt, writer=writer, action=action
    )


def kinds(charges: list[ledger.Charge]) -> list[tuple[int, int, int, str]]:
    return [(c.iteration, c.attempt, c.position, c.spend.value) for c in charges]


def test_calls_of_committed_iterations_are_kept() -> None:
    records: list[AnyEntry] = [
        claim(0, 1),
        model(0, 1, 0),
        commit(0, 1, Action.CONTINUE),
        model(1, 1, 0),
        model(1, 1, 2),
        commit(1, 1, Action.COMPLETE),
    ]
    assert kinds(ledger.charges(records)) == [
        (0, 1, 0, "kept"),
        (1, 1, 0, "kept"),
        (1, 1, 2, "kept"),
    ]
    split = ledger.split(ledger.charges(records))
    assert split.kept == Totals(
        calls=3, input_tokens=300, output_tokens=60, cached_tokens=120, cost_micros=21
    )
    assert split.spent == split.kept and split.retried == Totals() == split.fenced


def test_an_attempt_a_retry_replaced_is_retried_not_kept() -> None:
    """Positions are an attempt's own: a retry calls the model again, so the
    failed attempt's calls were spent and are kept by nobody."""
    records: list[AnyEntry] = [
        model(0, 1, 0),
        commit(0, 1, Action.FAIL),
        claim(0, 2),
        model(0, 2, 0),
        commit(0, 2, Action.COMPLETE),
    ]
    assert kinds(ledger.charges(records)) == [(0, 1, 0, "retried"), (0, 2, 0, "kept")]


def test_an_attempt_that_crashed_is_retried_once_a_later_attempt_started() -> None:
    """An attempt that never committed (its worker died, the lease ran out,
    the engine dispatched attempt 2): its calls are retried as soon as a later
    attempt of the iteration wrote anything."""
    records: list[AnyEntry] = [model(3, 1, 0), model(3, 1, 2), claim(3, 2)]
    assert kinds(ledger.charges(records)) == [(3, 1, 0, "retried"), (3, 1, 2, "retried")]
    assert kinds(ledger.charges(records[:2])) == [(3, 1, 0, "kept"), (3, 1, 2, "kept")]


def test_a_paused_attempt_is_retried() -> None:
    records: list[AnyEntry] = [model(0, 1, 0), commit(0, 1, Action.PAUSE)]
    assert kinds(ledger.charges(records)) == [(0, 1, 0, "retried")]


def test_a_fenced_call_is_charged_once_even_when_reported_twice_or_also_stored() -> None:
    zombie_stored = model(0, 1, 0, writer="zombie")
    records: list[AnyEntry] = [zombie_stored, model(0, 1, 2, writer="next")]
    spent = [
        model(0, 1, 0, writer="zombie"),  # stored after all: the record counts it
        model(0, 1, 2, writer="zombie"),  # refused by the fence: fenced
        model(0, 1, 2, writer="zombie"),  # reported again: once
    ]
    found = ledger.charges(records, spent)
    assert kinds(found) == [(0, 1, 0, "kept"), (0, 1, 2, "kept"), (0, 1, 2, "fenced")]
    split = ledger.split(found)
    assert split.fenced.calls == 1 and split.spent.calls == 3


def test_a_call_without_usage_is_not_charged() -> None:
    assert ledger.charges([model(0, 1, 0, usage=None)], [model(0, 1, 1, usage=None)]) == []


def test_usage_by_model() -> None:
    other = Usage(input_tokens=1, output_tokens=2, model="n")
    found = ledger.charges([model(0, 1, 0), model(0, 1, 1, usage=other), model(0, 1, 2)])
    totals = ledger.by_model(found)
    assert totals["m"].calls == 2 and totals["n"] == Totals(
        calls=1, input_tokens=1, output_tokens=2
    )


@pytest.mark.parametrize(
    ("spent", "budget", "refused"),
    [
        (Totals(input_tokens=60, output_tokens=39), Budget(tokens=100), False),
        (Totals(input_tokens=60, output_tokens=40), Budget(tokens=100), True),
        (Totals(input_tokens=60, output_tokens=41), Budget(tokens=100), True),
        (Totals(cost_micros=999), Budget(cost_micros=1000), False),
        (Totals(cost_micros=1000), Budget(cost_micros=1000), True),
        (Totals(input_tokens=10**9), Budget(cost_micros=1000), False),
        (Totals(cost_micros=5, input_tokens=100), Budget(tokens=100, cost_micros=1000), True),
    ],
)
def test_a_call_starts_only_while_the_run_spent_less_than_its_budget(
    spent: Totals, budget: Budget, refused: bool
) -> None:
    decision = ledger.decide_budget(spent, budget)
    assert isinstance(decision, ledger.OverBudget) is refused
    if isinstance(decision, ledger.OverBudget):
        assert decision.spent == spent and "budget" in decision.reason


def test_raises_add_to_the_bounds_the_budget_has() -> None:
    def placed(request_id: str, content: object, *, carried: bool = False) -> InputEntry:
        return InputEntry(
            seq=next(seq),
            iteration=0,
            attempt=1,
            writer="w",
            position=0,
            request_id=request_id,
            mode=ledger.BUDGET_MODE,
            content=json.dumps(content).encode(),
            carried=carried,
        )

    records = [
        placed("a", {"tokens": 50}),
        placed("a", {"tokens": 50}, carried=True),  # the same input, carried: once
        placed("b", {"tokens": 25, "cost": 0.5}),
    ]
    raised = ledger.raises(records)
    assert raised == Raise(tokens=75, cost_micros=500_000)
    budget = Budget(tokens=100, policy=Policy.PAUSE)
    assert budget.raised(raised) == Budget(tokens=175, policy=Policy.PAUSE)  # no cost bound added


def test_prices_per_million_tokens_with_cached_input_and_a_dated_model_name() -> None:
    table = parse_prices(json.dumps({"m": {"input": 2, "output": 8, "cached": 0.5}}))
    assert table == {"m": Price(input=2.0, output=8.0, cached=0.5)}
    # 60 fresh * 2 + 40 cached * 0.5 + 20 out * 8 micros
    assert price(U, table) == 60 * 2 + 40 * 0.5 + 20 * 8
    dated = Usage(input_tokens=1_000_000, model="m-2025-04-14")
    assert price(dated, table) == 2_000_000
    assert price(Usage(model="unknown"), table) is None


@pytest.mark.parametrize(
    "text",
    ["[1]", '{"m": {"input": 1}}', '{"m": {"input": -1, "output": 1}}', "{", '{"m": 3}'],
)
def test_a_bad_price_table_names_the_setting(text: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_prices(text)
    assert err.value.field == "DAGNATS_PRICES"


@pytest.mark.parametrize(
    "content", [None, {}, {"tokens": -1}, {"tokens": 0}, {"tokens": 1.5}, {"cost": "x"}, {"x": 1}]
)
def test_a_budget_input_must_raise_something(content: object) -> None:
    with pytest.raises(InvalidArgument):
        parse_raise(content)


def test_budget_documents() -> None:
    assert parse_budget({"tokens": 500, "policy": "pause"}) == Budget(
        tokens=500, policy=Policy.PAUSE
    )
    assert parse_budget({"cost": 0.25}) == Budget(cost_micros=250_000)
    for bad in ({}, {"tokens": 5, "policy": "later"}, {"cost": -1}, {"tokens": True}, [1]):
        with pytest.raises(InvalidArgument):
            parse_budget(bad)


def test_a_step_ledger_that_folds_ended_iterations_charges_as_the_rules_do() -> None:
    """The budget's reader keeps only the open iteration's entries and folds
    each ended iteration into totals: the same charges as the whole step."""
    other = Usage(input_tokens=3, output_tokens=4, model="n", cost_micros=1)
    records: list[AnyEntry] = [
        claim(0, 1),
        model(0, 1, 0),
        commit(0, 1, Action.FAIL),  # retried
        claim(0, 2),
        model(0, 2, 0, usage=other),
        commit(0, 2, Action.CONTINUE),  # iteration 0 ends: folded
        claim(1, 1, writer="z"),
        model(1, 1, 0, writer="z"),
        claim(1, 1, writer="s"),  # the successor fenced z
        model(1, 1, 0, writer="s"),
        commit(1, 1, Action.CONTINUE, writer="s"),
        model(2, 1, 0),  # open
        model(2, 1, 2, usage=other),
    ]
    spent = [
        model(1, 1, 0, writer="z"),  # stored after all: counted once
        model(1, 1, 2, writer="z"),  # refused by the fence
        model(2, 1, 2),  # stored in the open iteration
    ]
    step = StepLedger()
    for entry in records:
        step.add(entry)
    step.spent.extend(spent)
    whole = ledger.charges(records, spent)
    assert step.split() == ledger.split(whole)
    assert step.by_model() == ledger.by_model(whole)
    assert [e.iteration for e in step.open] == [2, 2]  # ended iterations folded
    assert step.split().fenced.calls == 1 and step.split().retried.calls == 1


def fork(iteration: int, attempt: int) -> ForkEntry:
    return ForkEntry(
        seq=next(seq),
        iteration=iteration,
        attempt=attempt,
        writer="",
        source_run="a" * 32,
        source_step="agent",
        at_seq=1,
        copied=1,
        digest="sha256:0",
    )


@pytest.mark.parametrize("resumes", ["mid_iteration", "next_iteration"])
def test_a_forks_copied_calls_are_copied_not_spent_by_the_forked_run(resumes: str) -> None:
    """The calls before a fork record are the source run's: charged copied,
    never to the forked run's spending, its budget or its models' totals;
    a fork of a fork copies its source's fork record too, and only the last
    one ends the copy. Read whole or folded iteration by iteration, alike."""
    copied: list[AnyEntry] = [
        claim(0, 1, writer="s"),
        model(0, 1, 0, writer="s"),
        fork(0, 1),  # the source was itself a fork: its prefix is copied too
        commit(0, 1, Action.CONTINUE, writer="s"),
        claim(1, 1, writer="s"),
        model(1, 1, 0, writer="s"),
    ]
    if resumes == "mid_iteration":
        records = [*copied, fork(1, 1), claim(1, 2), model(1, 2, 1)]
    else:
        records = [*copied, commit(1, 1, Action.CONTINUE, writer="s"), fork(2, 1)]
        records += [claim(2, 1), model(2, 1, 0)]
    whole = ledger.charges(records)
    assert [c.spend for c in whole] == [ledger.Spend.COPIED] * 2 + [ledger.Spend.KEPT]
    split = ledger.split(whole)
    assert (split.copied.calls, split.kept.calls, split.spent.calls) == (2, 1, 1)
    assert ledger.by_model(whole) == {"m": Totals().add(U)}
    step = StepLedger()
    for entry in records:
        step.add(entry)
    assert step.split() == split
    assert step.by_model() == ledger.by_model(whole)
