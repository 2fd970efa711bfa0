"""Helpers for testing handlers without a real model.

``ScriptedModel`` stands in for a model client: it answers each request with
the next response of a script and remembers every request, so a test can tell
a response replayed from the journal (no new request) from a new model call.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

__all__ = ["ScriptExhausted", "ScriptedModel"]


class ScriptExhausted(AssertionError):
    """The scripted model got more requests than it has responses.

    Attributes:
        request: The request that found no response.
        calls: Requests received, this one included.
    """

    def __init__(self, request: Any, calls: int, responses: int | None = None) -> None:
        scripted = calls - 1 if responses is None else responses
        super().__init__(
            f"scripted model has {scripted} response(s) but got request {calls}: {request!r}"
        )
        self.request = request
        self.calls = calls


class ScriptedModel:
    """An async model that answers with scripted responses, in order.

    ``await model(request)`` records a copy of ``request`` in :attr:`requests`
    and returns a deep copy of the next response, so a handler that mutates a
    response cannot change the script. A response that is an exception
    instance is raised instead, to script a failed model call.

    Args:
        responses: The answers, one per expected request.

    Attributes:
        requests: Every request received, in order (copied when received).
    """

    def __init__(self, responses: Sequence[Any]) -> None:
        self._responses = list(responses)
        self.requests: list[Any] = []

    @property
    def calls(self) -> int:
        """Requests received so far."""
        return len(self.requests)

    @property
    def remaining(self) -> int:
        """Scripted responses not yet used."""
        return max(len(self._responses) - self.calls, 0)

    async def __call__(self, request: Any) -> Any:
        """Answer ``request`` with the next scripted response.

        Raises:
            ScriptExhausted: every scripted response was already used.
            BaseException: the scripted response, when it is an exception.
        """
        self.requests.append(copy.deepcopy(request))
        index = self.calls - 1
        if index >= len(self._responses):
            raise ScriptExhausted(request, self.calls, len(self._responses))
        response = self._responses[index]
        if isinstance(response, BaseException):
            raise response
        return copy.deepcopy(response)
