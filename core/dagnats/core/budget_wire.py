"""A run's budget between its value (:class:`dagnats.core.usage.Budget`) and
its message (``dagnats.journal.v1.Budget``), for the engine, the journal and
the SDK alike."""

from __future__ import annotations

from dagnats.core.errors import InvalidArgument
from dagnats.core.usage import Budget, Policy
from dagnats.journal.v1 import journal_pb2 as pb

_POLICY = {Policy.FAIL: pb.BUDGET_POLICY_FAIL, Policy.PAUSE: pb.BUDGET_POLICY_PAUSE}


def budget_to_proto(budget: Budget) -> pb.Budget:
    return pb.Budget(
        tokens=budget.tokens, cost_micros=budget.cost_micros, policy=_POLICY[budget.policy]
    )


def budget_from_proto(msg: pb.Budget) -> Budget:
    """A budget as stored or as the journal is asked to check it (an unset
    policy is FAIL)."""
    policy = Policy.PAUSE if msg.policy == pb.BUDGET_POLICY_PAUSE else Policy.FAIL
    return Budget(tokens=msg.tokens, cost_micros=msg.cost_micros, policy=policy)


def check_budget(msg: pb.Budget, *, field: str = "budget") -> Budget:
    """A budget a request sent, checked.

    Raises:
        InvalidArgument: a negative bound, no bound, or an unknown policy.
    """
    if msg.tokens < 0 or msg.cost_micros < 0:
        raise InvalidArgument(f"{field}: a bound must be >= 0", field=field)
    if not msg.tokens and not msg.cost_micros:
        raise InvalidArgument(f"{field} bounds tokens, cost or both", field=field)
    if msg.policy not in (pb.BUDGET_POLICY_UNSPECIFIED, *_POLICY.values()):
        raise InvalidArgument(f"{field}.policy is not a policy", field=f"{field}.policy")
    return budget_from_proto(msg)
