"""What an engine reports of its configuration on ``/health``: does it run the scheduling
policy the gateway's configuration says it does, and how many requests does it run at once?

Lanes reach vLLM as each request's ``priority``, which vLLM 0.32 honours only when the
engine was started with ``--scheduling-policy priority`` and otherwise ignores without a
word. ``tokenpace serve``'s request guard reports the running engine's policy in a header
of its ``/health`` answers; the gateway reads it on every health check (the first one at
start-up) and shows a mismatch in its log and in its own ``/health``. Stock vLLM sends no
such header: its policy is then "unknown".

The same answers carry the engine's ``--max-num-seqs``: its capacity from the first health
check, where stock vLLM's is learned only once requests wait in it (``EngineSlots``).
"""

from __future__ import annotations

from collections.abc import Mapping

from ...engine import MAX_NUM_SEQS_HEADER, SCHEDULING_POLICY_HEADER

UNKNOWN = "unknown"


def reported_policy(headers: Mapping[str, str]) -> str:
    """The policy an engine's ``/health`` answer reports, or ``unknown``."""
    return headers.get(SCHEDULING_POLICY_HEADER) or UNKNOWN


def reported_capacity(headers: Mapping[str, str]) -> int | None:
    """The ``--max-num-seqs`` an engine's ``/health`` answer reports (None: none, or not a
    positive integer)."""
    value = headers.get(MAX_NUM_SEQS_HEADER, "")
    return int(value) if value.isascii() and value.isdigit() and 0 < int(value) < 1 << 31 else None


def policy_problem(url: str, configured: str, reported: str) -> str | None:
    """A warning when the gateway's lanes depend on a policy the engine does not run."""
    if configured != "priority" or reported == "priority":
        return None
    if reported == UNKNOWN:
        return (f"engine {url}: configured with scheduling_policy: priority, but the engine "
                "does not report its policy (not tokenpace serve?); lane priority holds only "
                "if it was started with --scheduling-policy priority")
    return (f"engine {url}: configured with scheduling_policy: priority, but the engine runs "
            f"'{reported}': lanes lose their priority there; restart it with "
            "--scheduling-policy priority or set scheduling_policy: fcfs")
