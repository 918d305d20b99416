"""End users inside a user: a second GCRA level, paced inside the user's own rate.

A gateway's tenant is one pacing user of the engine; the people behind it (the OpenAI
``user`` field of their requests) are its end users. With an end-user rate ``r``, each end
user's tokens are limited to ``r`` while the tenant's stay limited to its rate ``R``: a token
is dispatched only when both GCRAs allow it, and a refund returns both.

End users are namespaced by their user: the limiter key is the pair ``(user, end_user)``,
so two tenants' end users of the same name never share a quota (a pair, not a joined
string: no user id can make another's key). Their state is an ordinary
``OutputRateLimiter`` over those keys, with ``EndUserRates`` as its rate table (the
end-user rate of the key's user), so the same exact arithmetic, refund and idle cleanup
hold: an idle end user's state is dropped exactly as an idle user's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ._limiter import OutputRateLimiter

EndUserKey = tuple[str, str]
"""(user, end user)."""


class EndUserRates:
    """The end-user rate of each user: its own, else the default (None: not paced)."""

    __slots__ = ("default", "per_user")

    def __init__(self, default: float | None = None,
                 per_user: Mapping[str, float] | None = None) -> None:
        self.default = default
        self.per_user: dict[str, float] = dict(per_user or {})

    def rate(self, key: EndUserKey) -> float | None:
        """The rate of an end-user key: its user's end-user rate."""
        return self.per_user.get(key[0], self.default)

    def of_user(self, user: str) -> float | None:
        return self.per_user.get(user, self.default)

    def with_user(self, user: str, rate: float) -> EndUserRates:
        return EndUserRates(self.default, {**self.per_user, user: rate})


def end_user_limiter(rates: EndUserRates, clock_ns: Callable[[], int]) -> OutputRateLimiter:
    """A limiter over end-user keys on ``clock_ns`` (the user limiter's clock)."""
    return OutputRateLimiter(rates, clock_ns)  # type: ignore[arg-type]
