"""After a reload that changes weights, shares converge to the new
weights without a burst to one tenant.

Two tenants keep a backlog of equal requests in one lane; each dispatch charges its prompt
cost and, as it streams, its output cost. After a weight change the tenants' counters are
kept (they already hold service divided by the weight in force when it was given), so only
future service is divided by the new weights: the order moves at once to the new ratio,
and no tenant is served many times in a row to "catch up".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenpace.fairness import FairQueue, LaneSpec
from tokenpace.gateway import parse_config
from tokenpace.gateway.dispatch import Dispatcher

PROMPT, OUTPUT = 10.0, 90.0  # cost units of one request's prompt and of its output


def _serve(queue: FairQueue[int], n: int, seq: list[int], order: list[str]) -> None:
    """Dispatch ``n`` requests, each charged its output right after (one at a time in
    flight, as a saturated engine with one slot); keep both tenants backlogged."""
    for _ in range(n):
        item = queue.pop()
        assert item is not None
        tenant = "a" if item % 2 == 0 else "b"
        order.append(tenant)
        queue.charge(tenant, OUTPUT)
        seq[0] += 2
        queue.push(seq[0] if tenant == "a" else seq[0] + 1, tenant, PROMPT, PROMPT + OUTPUT)


def _run(change_to: float, before: int = 200, after: int = 400) -> list[str]:
    queue: FairQueue[int] = FairQueue([LaneSpec("batch", 0)], lambda: 0.0)
    queue.set_tenant("a", "batch", 1.0)
    queue.set_tenant("b", "batch", 1.0)
    seq = [0]
    for i in range(4):  # a backlog of two requests each, ids even for a, odd for b
        queue.push(2 * i + (i % 2), "a" if i % 2 == 0 else "b", PROMPT, PROMPT + OUTPUT)
    seq[0] = 10
    order: list[str] = []
    _serve(queue, before, seq, order)
    queue.set_tenant("a", "batch", change_to)  # the reload: a's weight 1 -> change_to
    _serve(queue, after, seq, order)
    return order


def _longest_run(order: list[str], tenant: str) -> int:
    best = run = 0
    for t in order:
        run = run + 1 if t == tenant else 0
        best = max(best, run)
    return best


@pytest.mark.parametrize("new_weight", [3.0, 1 / 3])
def test_shares_move_to_new_weights_at_once_without_a_burst(new_weight: float) -> None:
    order = _run(new_weight)
    before, after = order[:200], order[200:]
    assert before.count("a") == 100, "equal weights: equal shares before the change"
    share_a = new_weight / (new_weight + 1)
    # From the first window of 8 dispatches after the change, a's count is within one
    # request of its new share (6 of 8 at weight 3, 2 of 8 at weight 1/3).
    for start in range(0, len(after) - 8 + 1, 8):
        window = after[start:start + 8]
        assert abs(window.count("a") - 8 * share_a) <= 1, (start, window)
    # No catch-up burst: the favoured tenant is never served more than its ratio (3) plus
    # one in a row, the other never starved longer than that.
    heavy = "a" if new_weight > 1 else "b"
    assert _longest_run(after, heavy) <= 4
    assert _longest_run(after, "b" if heavy == "a" else "a") <= 1
    overall = after.count("a") / len(after)
    assert overall == pytest.approx(share_a, abs=0.01)


def test_a_gateway_reload_changes_weights_and_keeps_counters(tmp_path: Path) -> None:
    """The reload path (``Dispatcher.configure``) hands the queue the new weights and
    leaves every counter as it was: no tenant's position jumps."""
    base = {
        "engines": [{"url": "http://127.0.0.1:1", "models": ["m"]}],
        "ledger": f"sqlite:///{tmp_path / 'u.db'}",
        "tenants": [{"id": "a", "api_keys": ["ka"], "weight": 1},
                    {"id": "b", "api_keys": ["kb"], "weight": 1}],
    }
    config = parse_config(base)
    dispatcher = Dispatcher(config, lambda: 0.0)
    (pool,) = dispatcher.pools.values()
    queue = pool.queue
    for tenant in ("a", "b"):
        queue.set_tenant(tenant, "default", 1.0)  # declared by a first request
    queue.charge("a", 300.0)
    queue.charge("b", 100.0)
    base["tenants"][0]["weight"] = 3
    dispatcher.configure(parse_config(base))
    assert (queue.counter("a"), queue.counter("b")) == (300.0, 100.0)
    queue.charge("a", 300.0)  # the same service now moves a's counter a third as far
    queue.charge("b", 300.0)
    assert (queue.counter("a"), queue.counter("b")) == (400.0, 400.0)
