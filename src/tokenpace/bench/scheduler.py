"""`tokenpace bench scheduler`: CPU time per step of the real scheduler, stock vs paced.

Each case keeps R requests resident and decoding (one user per request) and times
``schedule()`` + ``update_from_output()`` with the process CPU clock. A fraction f of
the users is throttled: their rate is so low that after the first token they never have
quota again, so the paced scheduler skips them every step while stock vLLM runs them.

Each repeat builds a stock and a paced scheduler side by side and runs them in
alternating blocks of ``BLOCK`` steps, so that a change in the machine's load (other
processes on a shared box) hits both alike; the repeat's ratio is paced CPU over stock
CPU. The median ratio over the repeats is reported with a 95% bootstrap interval.
``--spec-tokens`` adds speculative decoding; ``--async-scheduling`` runs both schedulers
as vLLM's async scheduling does (each step planned while the previous one is in flight).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._cli import add_common_args, bench_model, fraction_list, int_list, positive_int, write_outputs
from ._environment import environment
from .overhead import median_interval

if TYPE_CHECKING:
    from ._simulate import Sim

THROTTLED_RATE = 1e-6  # tokens per second: one token, then none for ~11 days
FREE_RATE = 1e9
BLOCK = 10


def _build(model: Path, running: int, throttled_fraction: float | None, steps: int,
           spec_tokens: int = 0, is_async: bool = False) -> Sim:
    from ._simulate import make_sim  # vLLM's scheduler: imported when a case is built

    paced = throttled_fraction is not None
    n_throttled = round(running * (throttled_fraction or 0.0))
    pacing = None
    if paced:
        overrides = {f"t{i}": THROTTLED_RATE for i in range(n_throttled)}
        pacing = {"default_user_output_tokens_per_second": FREE_RATE,
                  "user_output_tokens_per_second": overrides}
    # With drafts a step can deliver up to 1 + k tokens per request.
    blocks_per_req = (16 + (steps + 64) * (1 + spec_tokens)) // 16 + 2
    sim = make_sim(
        model, pacing=pacing, paced_class=paced, max_num_seqs=running,
        max_num_batched_tokens=max(2048, running * 16), num_blocks=running * blocks_per_req + 16,
        max_model_len=4096, spec_tokens=spec_tokens, is_async=is_async,
    )
    for i in range(running):
        user = f"t{i}" if i < n_throttled else f"u{i}"
        sim.add(f"r{i}", user, prompt_len=16, max_tokens=(steps + 64) * (1 + spec_tokens))
    for _ in range(4):  # admit and prefill everything before timing
        sim.step()
    return sim


def _time_pair(stock: Sim, paced: Sim, steps: int) -> tuple[float, float]:
    """Mean CPU microseconds per step of each, run in alternating blocks."""
    stock.scheduler_cpu_ns = paced.scheduler_cpu_ns = 0
    done = 0
    while done < steps:
        block = min(BLOCK, steps - done)
        for sim in (stock, paced) if done // BLOCK % 2 == 0 else (paced, stock):
            for _ in range(block):
                sim.step()
        done += block
    return stock.scheduler_cpu_ns / steps / 1000.0, paced.scheduler_cpu_ns / steps / 1000.0


def run(model: Path, running_counts: list[int], fractions: list[float], steps: int,
        repeats: int, spec_tokens: int = 0, is_async: bool = False) -> dict[str, Any]:
    cases = []
    for running in running_counts:
        for fraction in fractions:
            stock_us, paced_us, ratios = [], [], []
            for _ in range(repeats):
                s, p = _time_pair(_build(model, running, None, steps, spec_tokens, is_async),
                                  _build(model, running, fraction, steps, spec_tokens, is_async),
                                  steps)
                stock_us.append(s)
                paced_us.append(p)
                ratios.append(p / s)
            s, p, r = statistics.median(stock_us), statistics.median(paced_us), statistics.median(ratios)
            low, high = median_interval(ratios)
            cases.append({
                "running": running,
                "throttled_fraction": fraction,
                "stock_us_per_step": round(s, 1),
                "paced_us_per_step": round(p, 1),
                "ratio": round(r, 3),
                "ratio_interval": [round(low, 3), round(high, 3)],
                "ratio_samples": [round(x, 3) for x in ratios],
                "stock_us_samples": [round(x, 1) for x in stock_us],
                "paced_us_samples": [round(x, 1) for x in paced_us],
            })
            print(f"running={running:5d} throttled={fraction:.2f} "
                  f"stock={s:9.1f} us/step paced={p:9.1f} us/step "
                  f"ratio={r:.3f} [{low:.3f}, {high:.3f}]", flush=True)
    return {"benchmark": "scheduler", "steps": steps, "repeats": repeats, "block": BLOCK,
            "spec_tokens": spec_tokens, "async_scheduling": is_async,
            "cases": cases, **environment()}


def plot(result: dict[str, Any], path: Path) -> None:
    """CPU per step, stock vs paced, one group of bars per (running, throttled) case."""
    from ._plots import pyplot, save

    plt = pyplot()
    cases = result["cases"]
    labels = [f"{c['running']}\n{c['throttled_fraction']:.0%} thr." for c in cases]
    xs = range(len(cases))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(cases) + 2), 3.6))
    ax.bar([x - 0.2 for x in xs], [c["stock_us_per_step"] / 1000 for c in cases], 0.4,
           label="stock vLLM")
    ax.bar([x + 0.2 for x in xs], [c["paced_us_per_step"] / 1000 for c in cases], 0.4,
           label="tokenpace")
    for x, c in zip(xs, cases):
        ax.annotate(f"x{c['ratio']:.2f}", (x + 0.2, c["paced_us_per_step"] / 1000),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("CPU ms per step (schedule + update)")
    ax.set_xlabel("running requests, throttled share of users")
    ax.legend(fontsize=8)
    save(fig, path)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Times vLLM's real scheduler with R resident decoding requests, "
                          "stock and paced, with a fraction of the users throttled.")
    add_common_args(parser)
    parser.add_argument("--running", type=int_list, default=[64, 256, 1024],
                        help="resident request counts (default 64,256,1024)")
    parser.add_argument("--throttled", type=fraction_list, default=[0.0, 0.5, 1.0],
                        help="throttled fractions of users (default 0,0.5,1)")
    parser.add_argument("--steps", type=positive_int, default=200, help="timed steps per run")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="alternating runs per case")
    parser.add_argument("--spec-tokens", type=int, default=0, metavar="K",
                        help="speculative decoding: K drafts per decode step, 70%% of them "
                        "accepted in turn (default 0: off)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="both schedulers as vLLM's async scheduling runs them (a step "
                        "planned before the previous one's results are in; default: sync)")


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.running, args.throttled, args.steps, args.repeats = [64], [0.0, 1.0], 20, 1
    result = run(bench_model(args), args.running, args.throttled, args.steps, args.repeats,
                 spec_tokens=args.spec_tokens, is_async=args.async_scheduling)
    return write_outputs(args, result, plot)
