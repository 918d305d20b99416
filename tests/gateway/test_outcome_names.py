"""The ledger's finish_reason strings (and so the requests metric's outcome label) that
users' ledgers and the dashboard in deploy/ read: the Outcome enum must keep making them."""

from __future__ import annotations

from tokenpace.gateway.exchange import Outcome


def test_every_outcome_keeps_its_ledger_string() -> None:
    assert Outcome.FINISHED.finish_reason("length") == "length"
    assert Outcome.FINISHED.finish_reason(None) == "stop"
    assert Outcome.REJECTED.finish_reason("queue_full") == "rejected:queue_full"
    assert {o.finish_reason() for o in Outcome if o not in (Outcome.FINISHED, Outcome.REJECTED)} \
        == {"cancelled", "client_disconnected", "timeout", "upstream_error", "error"}
