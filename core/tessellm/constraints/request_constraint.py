"""RequestConstraint: one request's llguidance matcher, as the Request's `constraint`.

It has consumed exactly the request's output tokens (Request.append_output feeds each one), so
it survives preemption (recompute keeps the output ids; swap keeps everything) with no work,
and a finished or aborted request drops it with the Request. `fork()` gives a sibling (n > 1)
a state of its own. The token mask of the next position is written by StepMasks (in a batch,
through llguidance's executor).
"""
from __future__ import annotations

from typing import Any


class RequestConstraint:
    __slots__ = ("matcher", "error")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.error: str | None = None

    def accept(self, token_id: int) -> bool:
        """Feed the sampled token; False (with `error` set) if the constraint refuses it."""
        if self.matcher.consume_token(token_id):
            return True
        self.error = (f"token {token_id} broke the request's output constraint: "
                      f"{self.matcher.get_error().strip()[:300]}")
        return False

    @property
    def is_terminated(self) -> bool:
        """No token but EOS may follow: the constrained output is complete."""
        return self.matcher.is_stopped()

    def fork(self) -> RequestConstraint:
        return RequestConstraint(self.matcher.deep_copy())
