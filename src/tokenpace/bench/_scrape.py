"""Reading the servers' ``/metrics`` pages during a bench: sums of samples, and waiting
until the gateways and engines hold no request."""

from __future__ import annotations

import time
from collections.abc import Sequence

import httpx

from ._load import tls_context

GATEWAY_BUSY = ("tokenpace_gateway_inflight_requests", "tokenpace_gateway_queued_requests")
ENGINE_BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def metric_sums(text: str, names: Sequence[str]) -> dict[str, float]:
    """Each of ``names`` summed over its samples (every label set) on one page; 0 if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    sums = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return sums


def metric_sum(text: str, names: Sequence[str]) -> float:
    """All samples of ``names`` on one page, summed."""
    return sum(metric_sums(text, names).values())


def wait_idle(engines: Sequence[str], gateways: Sequence[str], timeout_s: float = 120.0) -> None:
    """Until no gateway (base URLs) holds a request and no engine runs or queues one, polled
    every 0.5 s: the next run starts clean. RuntimeError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(verify=tls_context(), timeout=10) as http:
        while time.monotonic() < deadline:
            busy = sum(metric_sum(http.get(f"{url}/metrics").text, GATEWAY_BUSY)
                       for url in gateways)
            busy += sum(metric_sum(http.get(f"{url}/metrics").text, ENGINE_BUSY)
                        for url in engines)
            if busy == 0:
                return
            time.sleep(0.5)
    raise RuntimeError(f"engines or gateways still busy {timeout_s:.0f} s after a run ended")
