"""Levels inside a user: its applications and its end users, each a GCRA of its own.

A gateway's tenant is one pacing user of the engine; inside it are the programs it runs
(its applications, ``vllm_xargs.output_rate_application``) and the people behind them (the
OpenAI ``user`` field of their requests, ``vllm_xargs.output_rate_end_user``). With an
application rate ``A`` and an end-user rate ``r``, a token of a request that names both is
dispatched only when its end user's GCRA (``r``), its application's (``A``) and its user's
(``R``) all allow it, and the one refund point returns all three. A request that names
neither is paced under its user alone.

Inner levels are namespaced by their user: an end user's key is the pair ``(user, end
user)``, an application's the triple ``(user, application, "")``, so two tenants' end users
or applications of the same name never share a quota, and an end user never shares one
with an application (a tuple, not a joined string: no id can make another's key; the
lengths tell the kinds apart). Their state is one ordinary ``OutputRateLimiter`` over those
keys, with ``InnerRates`` as its rate table, so the same exact arithmetic, refund and idle
cleanup hold: an idle end user's or application's state is dropped exactly as an idle
user's. End users are per user: the same person using two of a tenant's applications is
one end user, at the user's end-user rate; except in an application that has an end-user
rate of its own, whose end users are its own (``(user, application, end user, "")``, at
that rate).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping

from ._limiter import OutputRateLimiter

EndUserKey = tuple[str, str]
"""(user, end user)."""
ApplicationKey = tuple[str, str, str]
"""(user, application, "")."""
ApplicationEndUserKey = tuple[str, str, str, str]
"""(user, application, end user, ""): an end user of an application with its own rate."""
InnerKey = Hashable
"""An ``EndUserKey`` or an ``ApplicationKey``."""


def inner_levels(user: str, application: str | None, end_user: str | None,
                 own_end_users: bool = False) -> tuple[InnerKey, ...]:
    """The inner levels a request of ``user`` is paced at, outermost first.
    ``own_end_users``: its application paces its end users at a rate of its own."""
    if application is None:
        return () if end_user is None else ((user, end_user),)
    if end_user is None:
        return ((user, application, ""),)
    if own_end_users:
        return ((user, application, ""), (user, application, end_user, ""))
    return ((user, application, ""), (user, end_user))


class InnerRates:
    """The rate of each inner key: an end user's is its user's end-user rate (its own,
    else the default; None: not paced); an application's is the one its trusted gateway
    sent (None until then: not paced)."""

    __slots__ = ("default", "per_user", "applications", "application_end_users")

    def __init__(self, default: float | None = None,
                 per_user: Mapping[str, float] | None = None,
                 applications: Mapping[tuple[str, str], float] | None = None,
                 application_end_users: Mapping[tuple[str, str], float] | None = None,
                 ) -> None:
        self.default = default
        self.per_user: dict[str, float] = dict(per_user or {})
        self.applications: dict[tuple[str, str], float] = dict(applications or {})
        # (user, application) -> the rate of that application's own end users.
        self.application_end_users: dict[tuple[str, str], float] = dict(
            application_end_users or {})

    def rate(self, key: InnerKey) -> float | None:
        """The rate of an inner key (the limiter's rate table)."""
        size = len(key)  # type: ignore[arg-type]
        if size == 2:
            return self.per_user.get(key[0], self.default)  # type: ignore[index]
        table = self.applications if size == 3 else self.application_end_users
        return table.get((key[0], key[1]))  # type: ignore[index]

    def of_user(self, user: str) -> float | None:
        """The end-user rate of ``user``'s end users."""
        return self.per_user.get(user, self.default)

    def of_application(self, user: str, application: str) -> float | None:
        return self.applications.get((user, application))

    def of_application_end_users(self, user: str, application: str) -> float | None:
        return self.application_end_users.get((user, application))

    def with_user(self, user: str, rate: float) -> InnerRates:
        """A copy in which ``user``'s end users are paced at ``rate``."""
        return InnerRates(self.default, {**self.per_user, user: rate}, self.applications,
                          self.application_end_users)

    def with_application(self, user: str, application: str, rate: float) -> InnerRates:
        """A copy in which ``user``'s ``application`` is paced at ``rate``."""
        return InnerRates(self.default, self.per_user,
                          {**self.applications, (user, application): rate},
                          self.application_end_users)

    def with_application_end_users(self, user: str, application: str,
                                   rate: float) -> InnerRates:
        """A copy in which the own end users of ``user``'s ``application`` are paced at
        ``rate``."""
        return InnerRates(self.default, self.per_user, self.applications,
                          {**self.application_end_users, (user, application): rate})


def inner_limiter(rates: InnerRates, clock_ns: Callable[[], int]) -> OutputRateLimiter:
    """A limiter over inner keys on ``clock_ns`` (the user limiter's clock)."""
    return OutputRateLimiter(rates, clock_ns)  # type: ignore[arg-type]
