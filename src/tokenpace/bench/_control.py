"""The control arm of ``tokenpace bench gateway --control byte-proxy``: the engine behind a
byte relay (``_byte_proxy``) in its own process, measured with the same pairs as the
gateway (a third call per pair, same prompt, the order cycling through all six orders).

What it separates: the gateway's added time to first token and its throughput and burst
ratios against direct mix two things, the gateway's own work and the mere fact of a second
process on the path (another process to schedule on a 2-core machine that the engine and
the load generator already fill, one more loopback hop each way). The byte relay has the
second and almost none of the first, so ``byte_proxy / direct`` is what any hop costs here
and ``gateway / byte_proxy`` what the gateway costs beyond it.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._process import Server, free_port
from ._load import StreamRecord
from ._paired import difference_summary, ratio_summary

CONTROLS = ("byte-proxy",)
PATH = "byte_proxy"
"""The control arm's name in the bench's per-path results."""
SALT = hashlib.sha256(b"tokenpace-bench-byte-proxy").hexdigest()
"""The control path's ``cache_salt``: the call goes to the engine as it is, so it carries
its own, as long as the gateway's and the direct path's and different from both (no call
of a pair finds another's prefix in the engine's cache)."""


def server(engine: Server, home: Path) -> Server:
    """The byte relay in front of ``engine``, in its own process (not started waiting)."""
    port = free_port()
    return Server([sys.executable, "-m", "tokenpace.bench._byte_proxy", str(port),
                   "127.0.0.1", str(engine.port)], port, home / "byte-proxy.log")


def summary(ttft: dict[str, list[float]], total: dict[str, list[float]],
            seq: dict[str, list[StreamRecord]], rates: dict[str, list[float]],
            burst: dict[str, list[float]], cpu_per_round: Sequence[float]) -> dict[str, Any]:
    """The control arm's figures, against direct and under the gateway's, all per pair."""
    same = sum(d.token_ids == c.token_ids for d, c in zip(seq["direct"], seq[PATH]))
    return {
        "kind": "byte-proxy",
        "same_output_pairs": same,
        "added_ttft_ms": difference_summary(ttft[PATH], ttft["direct"]),
        "added_total_ms": difference_summary(total[PATH], total["direct"]),
        "throughput_ratio": ratio_summary(rates[PATH], rates["direct"], 4),
        "burst_ttft_ratio": ratio_summary(burst[PATH], burst["direct"]),
        "cpu_s_per_round": [round(v, 4) for v in cpu_per_round],
        "gateway_over_control": {
            "added_ttft_ms": difference_summary(ttft["gateway"], ttft[PATH]),
            "throughput_ratio": ratio_summary(rates["gateway"], rates[PATH], 4),
            "burst_ttft_ratio": ratio_summary(burst["gateway"], burst[PATH]),
        },
    }


def line(control: dict[str, Any]) -> str:
    """One printed line of the control's main figures."""
    added, over = control["added_ttft_ms"], control["gateway_over_control"]
    return (f"byte proxy (control) against direct: TTFT p50 {added['p50']['value']:+.2f} ms "
            f"{added['p50']['interval95']}, throughput {control['throughput_ratio']['median']:.3f}"
            f" {control['throughput_ratio']['interval95']}, burst TTFT "
            f"{control['burst_ttft_ratio']['median']:.2f} {control['burst_ttft_ratio']['interval95']}"
            f"; gateway against the byte proxy: TTFT p50 "
            f"{over['added_ttft_ms']['p50']['value']:+.2f} ms "
            f"{over['added_ttft_ms']['p50']['interval95']}, throughput "
            f"{over['throughput_ratio']['median']:.3f} {over['throughput_ratio']['interval95']},"
            f" burst TTFT {over['burst_ttft_ratio']['median']:.2f} "
            f"{over['burst_ttft_ratio']['interval95']}")
