"""The four traffic classes of `tokenpace bench mix`, and what is measured of them.

Pure code: requests are drawn from a seeded generator, and the figures are computed from
client-side records, ledger rows and engine samples passed in, so all of it is tested
with made-up ones (no HTTP, no vLLM, no clock of its own).

The classes, one tenant each, as the gateway spec's launch checklist names them:

- ``short``: prompts of 25-75 tokens, 15-45 output tokens.
- ``context``: a shared document of ``DOCUMENT`` tokens followed by a question, 2,000 to
  3,500 prompt tokens in all, 8-32 output tokens (the document is what a prefix cache keeps).
- ``generation``: prompts of 32-96 tokens, 800-1,000 output tokens.
- ``agent``: operations of 6-10 calls in stages, a stage one call or 2-3 calls in
  parallel; each call's prompt is the operation's task, every earlier answer, then its own
  instruction; 20-60 output tokens a call. An operation's latency runs from its first
  call's send to its last answer.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._load import percentile
from ._service import Request, service_windows

VOCAB = (3, 512)  # the tiny model's ordinary token ids (0-2 are special)
PROMPT_COST, COMPLETION_COST = 1.0, 2.0
DOCUMENT = 1_900
"""Tokens of the context tenant's shared document (its prompts are 2,000-3,500 tokens)."""
CLASSES = ("short", "context", "generation", "agent")


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


@dataclass(frozen=True)
class Call:
    """One request an agent operation makes: its own instruction and output length."""

    instruction: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Operation:
    """One agent operation: a task, then stages of calls; the calls of a stage run in
    parallel, a stage starts when the one before it has answered."""

    task: list[int]
    stages: list[list[Call]]

    @property
    def calls(self) -> int:
        return sum(len(s) for s in self.stages)

    def prompt(self, answers: Sequence[Sequence[int]], call: Call) -> list[int]:
        """The prompt of ``call``: the task, every earlier answer in order, the instruction."""
        out = list(self.task)
        for answer in answers:
            out.extend(answer)
        out.extend(call.instruction)
        return out


class Workload:
    """Draws each class's requests from one seed (the same run for every arm)."""

    def __init__(self, seed: int) -> None:
        self._rng = {name: random.Random(f"{seed}-{name}") for name in CLASSES}
        self.document = _ids(random.Random(f"{seed}-document"), DOCUMENT)

    def request(self, name: str) -> tuple[list[int], int]:
        """The next (prompt token ids, max_tokens) of class ``name`` (not ``agent``)."""
        rng = self._rng[name]
        if name == "short":
            return _ids(rng, rng.randint(25, 75)), rng.randint(15, 45)
        if name == "context":
            question = rng.randint(2_000, 3_500) - DOCUMENT
            return self.document + _ids(rng, question), rng.randint(8, 32)
        if name == "generation":
            return _ids(rng, rng.randint(32, 96)), rng.randint(800, 1_000)
        raise ValueError(f"no single requests in class {name!r}")

    def operation(self) -> Operation:
        rng = self._rng["agent"]
        left = rng.randint(6, 10)
        stages: list[list[Call]] = []
        while left:
            size = 1 if rng.random() < 0.5 else min(left, rng.randint(2, 3))
            stages.append([Call(_ids(rng, rng.randint(8, 16)), rng.randint(20, 60))
                           for _ in range(size)])
            left -= size
        return Operation(_ids(rng, rng.randint(64, 128)), stages)


@dataclass
class Sent:
    """One request as the client saw it: its tenant's class, when it was sent (seconds
    from the arm's start) and when each token arrived."""

    name: str
    sent: float
    prompt_tokens: int
    token_times: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class LedgerRow:
    """What the arm reads of one ledger row: its class, when it started (seconds from the
    arm's start), its queue time and prompt tokens, how many of them the engine had cached."""

    name: str
    started: float
    queue_ms: float | None
    prompt_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class EngineSample:
    """The engines' gauges and counters at one instant (seconds from the arm's start),
    summed over the engines: running requests, prompt tokens, those of them found in the
    prefix cache, generated tokens."""

    at: float
    running: float
    prompt_tokens: float
    cached_tokens: float
    generation_tokens: float


def _quantiles(values: Sequence[float], digits: int = 1) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "n": 0}
    return {"p50": round(percentile(values, 50), digits),
            "p95": round(percentile(values, 95), digits), "n": len(values)}


def summarize(sent: Sequence[Sent], operations: Sequence[tuple[float, float]],
              rows: Sequence[LedgerRow], engine: Sequence[EngineSample],
              weights: Mapping[str, float], start: float, end: float,
              window_s: float) -> dict[str, Any]:
    """One arm's figures over the measured window ``[start, end)`` (seconds from the arm's
    start; before ``start`` the queues fill).

    Service is the gateway's cost (``PROMPT_COST`` per prompt token when the first token
    arrives, ``COMPLETION_COST`` per output token as it arrives), each tenant's share of
    it against its weight's share; TTFT and time per output token of the requests sent
    in the window; queue time and cached prompt tokens from the ledger rows that started
    in it; agent operations that started in it and ended; ``engine``: the engines' samples
    through the arm: the mean of their running requests in the window, and the tokens they
    computed in it (prompt tokens not found in the cache, and generated ones) per second,
    from the first and last sample inside it.
    """
    reqs = [Request(s.name, s.sent, s.prompt_tokens, s.token_times) for s in sent]
    windows = service_windows(reqs, list(weights), start, end, window_s,
                              PROMPT_COST, COMPLETION_COST)
    served = {n: sum(rates) * window_s for n, rates in windows.rates.items()}
    total = sum(served.values())
    weight_total = sum(weights.values())
    tenants: dict[str, Any] = {}
    for name, weight in weights.items():
        mine = [s for s in sent if s.name == name and start <= s.sent < end]
        ttft = [(s.token_times[0] - s.sent) * 1000 for s in mine if s.token_times]
        tpot = [(s.token_times[-1] - s.token_times[0]) * 1000 / (len(s.token_times) - 1)
                for s in mine if len(s.token_times) > 1]
        mine_rows = [r for r in rows if r.name == name and start <= r.started < end]
        queue = [r.queue_ms for r in mine_rows if r.queue_ms is not None]
        prompt = sum(r.prompt_tokens for r in mine_rows)
        share = served[name] / total if total else None
        tenants[name] = {
            "weight_share": round(weight / weight_total, 4),
            "service_share": None if share is None else round(share, 4),
            "share_error": None if share is None else round(share - weight / weight_total, 4),
            "backlogged": round(statistics.fmean(windows.backlogged[name]), 3),
            "service_per_window": [round(x * window_s, 1) for x in windows.rates[name]],
            "requests_sent": len(mine),
            "ttft_ms": _quantiles(ttft),
            "time_per_output_token_ms": _quantiles(tpot, 2),
            "queue_ms": _quantiles(queue),
            "prompt_tokens": prompt,
            "prefix_hit_rate": (round(sum(r.cached_prompt_tokens for r in mine_rows) / prompt, 4)
                                if prompt else None),
            "requests_ended": sum(1 for s in mine if s.token_times and s.token_times[-1] < end),
        }
    if "agent" in tenants:
        tenants["agent"]["operation_s"] = _quantiles(
            [e - s for s, e in operations if start <= s < end], 3)
    tokens = sum(1 for s in sent for t in s.token_times if start <= t < end)
    in_window = [r for r in rows if start <= r.started < end]
    prompt = sum(r.prompt_tokens for r in in_window)
    cached = sum(r.cached_prompt_tokens for r in in_window)
    inside = [e for e in engine if start <= e.at < end]
    computed = None
    if len(inside) >= 2 and inside[-1].at > inside[0].at:
        first, last = inside[0], inside[-1]
        work = ((last.prompt_tokens - last.cached_tokens)
                - (first.prompt_tokens - first.cached_tokens)
                + last.generation_tokens - first.generation_tokens)
        computed = round(work / (last.at - first.at), 1)
    return {
        "tenants": tenants,
        "max_share_error": max((abs(t["share_error"]) for t in tenants.values()
                                if t["share_error"] is not None), default=None),
        "output_tokens_per_s": round(tokens / (end - start), 1),
        "cost_per_s": round(total / (end - start), 1),
        "requests_per_s": round(sum(t["requests_ended"] for t in tenants.values())
                                / (end - start), 2),
        "engine_tokens_per_s": computed,
        "prefix_hit_rate": round(cached / prompt, 4) if prompt else None,
        "mean_running": round(statistics.fmean(e.running for e in inside), 2) if inside else None,
        "window_midpoints_s": [round(x, 3) for x in windows.midpoints()],
    }


def goals(arms: Mapping[str, Mapping[str, Any]], fair: str = "vtc", order: str = "fcfs",
          weighted: str | None = "vtc_weighted", tolerance: float = 0.05) -> dict[str, Any]:
    """The issue's goals from the arms' summaries: shares within ``tolerance`` of the
    weights (the VTC arms), VTC's throughput and prefix hit rate against FCFS's (>= 0.95),
    and the agent's operation latency against FCFS beside what its share says."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 3)

    vtc, fcfs = arms[fair], arms[order]
    out: dict[str, Any] = {"share_tolerance": tolerance}
    for arm in (fair, weighted):
        if arm is not None and arm in arms:
            error = arms[arm]["max_share_error"]
            out[f"{arm}_max_share_error"] = error
            out[f"{arm}_shares_met"] = error is not None and error <= tolerance
    out["throughput_vtc_over_fcfs"] = ratio(vtc["output_tokens_per_s"], fcfs["output_tokens_per_s"])
    out["cost_rate_vtc_over_fcfs"] = ratio(vtc["cost_per_s"], fcfs["cost_per_s"])
    out["prefix_hit_vtc_over_fcfs"] = ratio(vtc["prefix_hit_rate"], fcfs["prefix_hit_rate"])
    # The cache's own effect, without the mix's: each tenant's hit rate under VTC, weighted
    # by its prompt tokens under FCFS (a policy that serves more long-context requests has
    # a higher overall rate with the same cache behaviour).
    fcfs_prompt = {n: t["prompt_tokens"] for n, t in fcfs["tenants"].items()}
    same_mix = sum((vtc["tenants"][n]["prefix_hit_rate"] or 0.0) * p
                   for n, p in fcfs_prompt.items())
    total_prompt = sum(fcfs_prompt.values())
    out["prefix_hit_vtc_on_fcfs_mix_over_fcfs"] = ratio(
        same_mix / total_prompt if total_prompt else None, fcfs["prefix_hit_rate"])
    out["engine_tokens_vtc_over_fcfs"] = ratio(vtc["engine_tokens_per_s"],
                                               fcfs["engine_tokens_per_s"])
    out["requests_vtc_over_fcfs"] = ratio(vtc["requests_per_s"], fcfs["requests_per_s"])
    agent_v, agent_f = vtc["tenants"]["agent"], fcfs["tenants"]["agent"]
    out["agent_operation_p50_vtc_over_fcfs"] = ratio(agent_v["operation_s"]["p50"],
                                                     agent_f["operation_s"]["p50"])
    # What the share says: with a share s the agent's calls get s of the pool, so its
    # operations may take (fcfs share / vtc share) as long as under FCFS.
    out["agent_share_fcfs_over_vtc"] = ratio(agent_f["service_share"], agent_v["service_share"])
    return out
