"""What a handler passes for the usage ledger and a run's budget.

A model call's usage is what the journal records with its response: the
model adapters fill it from the provider's answer; a handler's own call
returns :class:`WithUsage` from the function it journals. A run's budget is
given when it starts (``Client.start(..., budget=Budget(...))``) or by its
workflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dagnats.core.budget_wire import budget_to_proto
from dagnats.core.errors import InvalidArgument
from dagnats.core.usage import Usage, parse_budget
from dagnats.journal.v1 import journal_pb2 as jpb

__all__ = ["Budget", "Usage", "WithUsage", "usage_to_proto"]


@dataclass(frozen=True, slots=True)
class WithUsage:
    """A model call's response with what the call spent: return it from the
    function given to ``Journal.model`` and the journal records ``value`` as
    the response and ``usage`` beside it; the call returns ``value``."""

    value: Any
    usage: Usage


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """What a run's model calls may spend.

    Args:
        tokens: Most input plus output tokens; 0 for no bound.
        cost: Most cost, in the price table's currency (``DAGNATS_PRICES``);
            0 for no bound.
        policy: ``"fail"``: the step whose call is refused fails for good;
            ``"pause"``: it waits for an input of mode ``BUDGET`` that raises
            the budget, then goes on.
    """

    tokens: int = 0
    cost: float = 0.0
    policy: Literal["fail", "pause"] = "fail"

    def to_proto(self) -> jpb.Budget:
        """The budget as the engine takes it.

        Raises:
            InvalidArgument: a negative bound, no bound at all, or another policy.
        """
        data = {"tokens": self.tokens, "cost": self.cost, "policy": self.policy}
        return budget_to_proto(parse_budget(data))


def usage_to_proto(usage: Usage) -> jpb.Usage:
    """A call's usage as the journal records it.

    Raises:
        InvalidArgument: ``usage`` is not a ``Usage``.
    """
    if not isinstance(usage, Usage):
        raise InvalidArgument("usage must be a dagnats.sdk.Usage", field="usage")
    return jpb.Usage(
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        cached_tokens=usage.cached_tokens,
        model=usage.model,
        cost_micros=usage.cost_micros or 0,
        priced=usage.cost_micros is not None,
    )
