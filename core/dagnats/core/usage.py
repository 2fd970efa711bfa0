"""Usage and budgets as plain values: what a model call spent, what a price
table makes of it, and what a run may spend.

Pure: no I/O. The journal service prices each recorded call with the table
of ``DAGNATS_PRICES`` (:func:`parse_prices`, :func:`price`); the ledger's
rules (``dagnats.journal.ledger``) add calls up and decide a budget.

A cost is an integer in millionths of the price table's currency (``cost
micros``), so totals add up exactly. A price is per million tokens, so a
call's cost in micros is ``tokens * price`` for each kind of token.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from dagnats.core.errors import InvalidArgument

MICROS = 1_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """What one model call spent, as its provider reported it.

    ``input_tokens`` counts every token the request read, the cached ones
    included; ``cached_tokens`` says how many of them came from the
    provider's prompt cache. ``cost_micros`` is set by the journal service
    from its price table (None: not priced).
    """

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    model: str = ""
    cost_micros: int | None = None

    @property
    def tokens(self) -> int:
        """Input and output tokens: what a budget's tokens count."""
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class Totals:
    """The usage of several calls, added up."""

    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cost_micros: int = 0

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def add(self, usage: Usage) -> Totals:
        return Totals(
            calls=self.calls + 1,
            input_tokens=self.input_tokens + usage.input_tokens,
            output_tokens=self.output_tokens + usage.output_tokens,
            cached_tokens=self.cached_tokens + usage.cached_tokens,
            cost_micros=self.cost_micros + (usage.cost_micros or 0),
        )

    def plus(self, other: Totals) -> Totals:
        return Totals(
            calls=self.calls + other.calls,
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cached_tokens=self.cached_tokens + other.cached_tokens,
            cost_micros=self.cost_micros + other.cost_micros,
        )


class Policy(enum.Enum):
    """What a run does when its budget refuses a model call."""

    FAIL = "fail"
    PAUSE = "pause"


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """What a run's model calls may spend; 0 means no bound of that kind."""

    tokens: int = 0
    cost_micros: int = 0
    policy: Policy = Policy.FAIL

    def raised(self, by: Raise) -> Budget:
        return Budget(
            tokens=self.tokens + by.tokens if self.tokens else 0,
            cost_micros=self.cost_micros + by.cost_micros if self.cost_micros else 0,
            policy=self.policy,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Raise:
    """What an input of mode BUDGET adds to a run's budget."""

    tokens: int = 0
    cost_micros: int = 0

    def plus(self, other: Raise) -> Raise:
        return Raise(
            tokens=self.tokens + other.tokens, cost_micros=self.cost_micros + other.cost_micros
        )


def parse_raise(content: object) -> Raise:
    """The raise an input of mode BUDGET carries: ``{"tokens": N, "cost": X}``,
    either or both, non-negative, at least one above zero.

    Raises:
        InvalidArgument: the content is not such an object (field ``content``).
    """
    if not isinstance(content, dict) or not content or set(content) - {"tokens", "cost"}:
        raise InvalidArgument(
            'a budget input\'s content is {"tokens": N, "cost": X} (either or both)',
            field="content",
        )
    tokens = content.get("tokens", 0)
    cost = content.get("cost", 0)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise InvalidArgument("content.tokens must be a whole number >= 0", field="content")
    micros = _micros(cost, field="content")
    if tokens == 0 and micros == 0:
        raise InvalidArgument("a budget input must raise tokens or cost", field="content")
    return Raise(tokens=tokens, cost_micros=micros)


def _micros(value: object, *, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgument(f"{field}: a cost must be a finite number", field=field)
    if value < 0:
        raise InvalidArgument(f"{field}: a cost must be >= 0", field=field)
    return round(value * MICROS)


@dataclass(frozen=True, slots=True, kw_only=True)
class Price:
    """A model's price per million tokens of each kind. ``cached`` applies to
    the cached input tokens instead of ``input`` (``input`` when unset)."""

    input: float
    output: float
    cached: float | None = None


Prices = Mapping[str, Price]


def parse_prices(text: str) -> dict[str, Price]:
    """The price table of ``DAGNATS_PRICES``: a JSON object mapping a model's
    name to its prices per million tokens,
    ``{"gpt-4.1-mini": {"input": 0.4, "output": 1.6, "cached": 0.1}}``.

    Raises:
        InvalidArgument: not such an object (field ``DAGNATS_PRICES``).
    """
    field = "DAGNATS_PRICES"
    try:
        data = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as err:
        raise InvalidArgument(f"{field} is not JSON: {err}", field=field) from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{field} must be a JSON object of models", field=field)
    table: dict[str, Price] = {}
    for model, entry in data.items():
        if not isinstance(entry, dict) or not {"input", "output"} <= set(entry):
            raise InvalidArgument(
                f"{field}[{model!r}] must have input and output prices", field=field
            )
        prices = {k: _price(entry, k, model) for k in ("input", "output", "cached") if k in entry}
        table[model] = Price(**prices)
    return table


def _price(entry: dict[str, object], kind: str, model: str) -> float:
    value = entry[kind]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgument(
            f"DAGNATS_PRICES[{model!r}].{kind} must be a number", field="DAGNATS_PRICES"
        )
    if value < 0:
        raise InvalidArgument(
            f"DAGNATS_PRICES[{model!r}].{kind} must be >= 0", field="DAGNATS_PRICES"
        )
    return float(value)


def price(usage: Usage, prices: Prices) -> int | None:
    """The cost of ``usage`` in micros, or None when the table has no price
    for its model (a name the provider returned with a date suffix, such as
    ``gpt-4.1-mini-2025-04-14``, takes the price of its longest listed prefix)."""
    found = prices.get(usage.model)
    if found is None:
        names = [name for name in prices if usage.model.startswith(name + "-")]
        if not names:
            return None
        found = prices[max(names, key=len)]
    cached_price = found.input if found.cached is None else found.cached
    fresh = max(usage.input_tokens - usage.cached_tokens, 0)
    cost = fresh * found.input + usage.cached_tokens * cached_price
    return round(cost + usage.output_tokens * found.output)


_BUDGET_KEYS = frozenset({"tokens", "cost", "policy"})


def parse_budget(value: object, path: str = "budget") -> Budget:
    """A budget written in a workflow document or a request:
    ``{"tokens": N, "cost": X, "policy": "fail" | "pause"}``, a bound or both.

    Raises:
        InvalidArgument: naming the field at ``path``.
    """
    if not isinstance(value, Mapping) or set(value) - _BUDGET_KEYS:
        raise InvalidArgument(f"{path} is a mapping of tokens, cost and policy", field=path)
    tokens = value.get("tokens", 0)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise InvalidArgument(f"{path}.tokens must be a whole number >= 0", field=f"{path}.tokens")
    micros = _micros(value.get("cost", 0), field=f"{path}.cost")
    if not tokens and not micros:
        raise InvalidArgument(f"{path} bounds tokens, cost or both", field=path)
    policy = value.get("policy", Policy.FAIL.value)
    if policy not in {p.value for p in Policy}:
        raise InvalidArgument(f"{path}.policy is fail or pause", field=f"{path}.policy")
    return Budget(tokens=tokens, cost_micros=micros, policy=Policy(policy))


def budget_mapping(budget: Budget) -> dict[str, object]:
    """``budget`` as :func:`parse_budget` reads it."""
    data: dict[str, object] = {"policy": budget.policy.value}
    if budget.tokens:
        data["tokens"] = budget.tokens
    if budget.cost_micros:
        data["cost"] = budget.cost_micros / MICROS
    return data
