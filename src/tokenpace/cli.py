"""The ``tokenpace`` command line."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from .tiny_model import TinyModelError, write_tiny_model

    try:
        written = write_tiny_model(args.dir, force=args.force)
    except TinyModelError as exc:
        print(f"tokenpace tiny-model: error: {exc}", file=sys.stderr)
        return 2
    print(f"{'wrote' if written else 'up to date:'} tiny model in {args.dir}")
    return 0


def _int_list(value: str) -> list[int]:
    try:
        items = [int(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}")
    if not items or any(x <= 0 for x in items):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {value!r}")
    return items


def _fraction_list(value: str) -> list[float]:
    try:
        items = [float(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {value!r}")
    if not items or any(not 0.0 <= x <= 1.0 for x in items):
        raise argparse.ArgumentTypeError(f"fractions must lie in [0, 1], got {value!r}")
    return items


def _default_model_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenpace" / "tiny-model"


def _bench_model(args: argparse.Namespace) -> Path:
    from .tiny_model import write_tiny_model

    if args.model is not None:
        return Path(args.model)
    model = _default_model_dir()
    write_tiny_model(model)
    return model


def _bench_outputs(args: argparse.Namespace, module: object, result: dict) -> int:
    from .bench import write_json

    if args.json:
        write_json(result, Path(args.json))
        print(f"wrote {args.json}")
    if args.plot:
        module.plot(result, Path(args.plot))  # type: ignore[attr-defined]
        print(f"wrote {args.plot}")
    return 0


def _cmd_bench_scheduler(args: argparse.Namespace) -> int:
    from .bench import scheduler

    if args.quick:
        args.running, args.throttled, args.steps, args.repeats = [64], [0.0, 1.0], 20, 1
    result = scheduler.run(_bench_model(args), args.running, args.throttled, args.steps,
                           args.repeats, spec_tokens=args.spec_tokens)
    return _bench_outputs(args, scheduler, result)


def _cmd_bench_pacing(args: argparse.Namespace) -> int:
    from .bench import pacing

    tokens = 40 if args.quick else args.tokens
    modes = ["sync"] if args.quick else args.modes
    # --quick: the warm-up unpaced (it warms the engine, it measures nothing)
    result = pacing.run(_bench_model(args), modes, tokens, [1, 4],
                        serve_flags=shlex.split(args.serve_flags),
                        warmup_rate=1_000_000.0 if args.quick else None)
    return _bench_outputs(args, pacing, result)


def _cmd_bench_overhead(args: argparse.Namespace) -> int:
    from .bench import overhead

    if args.quick:
        args.streams, args.tokens, args.repeats = 8, 64, 1
    result = overhead.run(_bench_model(args), args.streams, args.tokens, args.repeats)
    return _bench_outputs(args, overhead, result)


def _cmd_bench_idle(args: argparse.Namespace) -> int:
    from .bench import idle

    if args.quick:
        result = idle.run(_bench_model(args), 2.0, names=("idle_wait", "busy_loop"),
                          warmup_tokens=2)
    else:
        result = idle.run(_bench_model(args), args.window)
    return _bench_outputs(args, idle, result)


def _cmd_bench_gateway(args: argparse.Namespace) -> int:
    from .bench import gateway

    if args.redis is not None:
        args.state = "redis"
    if args.state == "redis":
        from .bench import RedisServer, redis_server_binary

        # Before the engine starts (a minute on the CPU), not after.
        if args.redis is None:
            redis_server_binary("tokenpace bench gateway", "--state redis")
        else:
            RedisServer.given(args.redis, "tokenpace bench gateway").stop()
    if args.quick:
        args.requests, args.streams, args.stream_tokens, args.rounds = 10, 8, 32, 3
    result = gateway.run(_bench_model(args), args.requests, args.tokens, args.streams,
                         args.stream_tokens, args.rounds, state=args.state,
                         redis_url=args.redis, control=args.control,
                         fast_requests=300 if args.quick else None)
    return _bench_outputs(args, gateway, result)


def _cmd_bench_fairness(args: argparse.Namespace) -> int:
    from .bench import fairness

    if args.quick:
        # 4 in flight: at 16 the tiny model's capacity asks the Python load generator for
        # ~100 streamed requests a second, more than it keeps up with on 2 cores beside the
        # engine and two gateways (its late reads then decide the measured shares).
        # 6 s runs in 2 s windows; on_off's second tenant is on from 1.5 to 3 s and from
        # 4.5 s (under FCFS its first request, behind the flood's backlog, starts before
        # the end unless the engine runs at under 40% of the calibrated capacity).
        args.duration, args.period, args.window, args.calibration = 6.0, 1.5, 2.0, 3.0
        args.max_inflight = 4
    if args.window > args.duration:
        raise SystemExit("tokenpace bench fairness: error: --window must not exceed --duration")
    if len(set(args.replicas)) > 8:
        raise SystemExit("tokenpace bench fairness: error: --replicas takes at most 8 counts")
    result = fairness.run(_bench_model(args), args.duration, args.period, args.window,
                          args.max_inflight, args.calibration, args.seed,
                          replicas=args.replicas)
    return _bench_outputs(args, fairness, result)


def _cmd_bench_fleet(args: argparse.Namespace) -> int:
    from .bench import conversations, fleet

    if args.workload == "conversations":
        if args.quick:
            result = conversations.run(_bench_model(args), duration=12.0, warmup=2.0, rounds=1)
        else:
            if args.warmup >= args.duration:
                raise SystemExit("tokenpace bench fleet: error: --warmup must be below --duration")
            result = conversations.run(_bench_model(args), args.duration, args.warmup,
                                       args.rounds)
        return _bench_outputs(args, conversations, result)
    if args.quick:
        result = fleet.run(_bench_model(args), duration=4.0, warmup=1.0, rounds=1,
                           streams=args.streams, max_inflight=args.max_inflight,
                           paced_rate=args.paced_rate, paced_s=2.0, code_engine=False)
    else:
        if args.warmup >= args.duration:
            raise SystemExit("tokenpace bench fleet: error: --warmup must be below --duration")
        result = fleet.run(_bench_model(args), args.duration, args.warmup, args.rounds,
                           args.streams, args.max_inflight, args.tokens, args.paced_rate,
                           args.paced_seconds)
    return _bench_outputs(args, fleet, result)


def _cmd_bench_batch(args: argparse.Namespace) -> int:
    from .bench import batch

    if args.quick:
        result = batch.run(_bench_model(args), duration=8.0, warmup=2.0, rounds=1,
                           rate=args.rate, max_tokens=args.tokens, batch_lines=1500,
                           headroom=args.headroom, layout=args.layout)
    else:
        if args.warmup >= args.duration:
            raise SystemExit("tokenpace bench batch: error: --warmup must be below --duration")
        result = batch.run(_bench_model(args), args.duration, args.warmup, args.rounds,
                           args.rate, args.tokens, headroom=args.headroom,
                           layout=args.layout)
    return _bench_outputs(args, batch, result)


def _cmd_bench_failover(args: argparse.Namespace) -> int:
    from .bench import failover

    if args.plot:
        raise SystemExit("tokenpace bench failover: error: --plot is not supported (use --json)")
    if args.quick:
        args.kill_after, args.down_for, args.after_back = 5.0, 3.0, 5.0
    result = failover.run(_bench_model(args), args.kill_after, args.down_for, args.after_back,
                          args.streams, args.tokens, args.max_inflight, args.restart_timeout)
    return _bench_outputs(args, failover, result)


def _cmd_bench_metering(args: argparse.Namespace) -> int:
    from .bench import metering

    if args.plot:
        raise SystemExit("tokenpace bench metering: error: --plot is not supported (use --json)")
    if args.quick:
        # the kill at 7 s, the outage from 10.5 to 13.5 s, the bad models at 3.5 s
        args.duration, args.kills, args.outage = 14.0, 1, 3.0
    if args.outage < 0:
        raise SystemExit("tokenpace bench metering: error: --outage must not be negative")
    if args.gateway_src is not None and not (args.gateway_src / "tokenpace" / "cli.py").is_file():
        raise SystemExit(f"tokenpace bench metering: error: --gateway-src: no tokenpace package "
                         f"in {args.gateway_src} (give the src/ directory of a checkout)")
    try:
        result = metering.run(_bench_model(args), args.duration, args.kills, args.outage,
                              args.loops, args.seed, gateway_src=args.gateway_src)
    except metering.PostgresUnavailable as exc:
        raise SystemExit(f"tokenpace bench metering: error: needs a PostgreSQL server: {exc}")
    return _bench_outputs(args, metering, result)


def _cmd_bench_hostile(args: argparse.Namespace) -> int:
    from .bench import hostile

    if args.duration is None:
        args.duration = 5.0 if args.quick else 15.0
    if args.baseline is None:
        args.baseline = 4.0 if args.quick else 8.0
    if args.gateway_src is not None and not (args.gateway_src / "tokenpace" / "cli.py").is_file():
        raise SystemExit(f"tokenpace bench hostile: error: --gateway-src: no tokenpace package "
                         f"in {args.gateway_src} (give the src/ directory of a checkout)")
    attacks = args.attacks or list(hostile.ATTACKS)
    unknown = [a for a in attacks if a not in hostile.ATTACKS]
    if unknown:
        raise SystemExit(f"tokenpace bench hostile: error: --attacks: unknown "
                         f"{', '.join(unknown)}; known: {', '.join(hostile.ATTACKS)}")
    result = hostile.run(None if args.engine_url else _bench_model(args), attacks,
                         args.duration, args.baseline, args.rate, args.victim_timeout,
                         quick=args.quick, engine_url=args.engine_url,
                         gateway_src=args.gateway_src)
    return _bench_outputs(args, hostile, result)


def _cmd_bench_state(args: argparse.Namespace) -> int:
    from .bench import state

    if args.quick:
        args.requests, args.repeats = 200, 2
    result = state.run(args.requests, args.concurrency, args.repeats, args.redis)
    return _bench_outputs(args, state, result)


def _cmd_bench_tenants(args: argparse.Namespace) -> int:
    from .bench import tenants

    if args.quick:
        args.configured, args.requests, args.repeats, args.events = [100, 2000], 400, 2, 2
    if len(args.configured) < 2:
        raise SystemExit("tokenpace bench tenants: error: --configured needs two counts or more "
                         "(the first is the baseline of the CPU ratio)")
    result = tenants.run(args.configured, args.active, args.requests, args.clients,
                         args.repeats, args.events, args.format)
    return _bench_outputs(args, tenants, result)


def _counts(value: str) -> list[int]:
    try:
        counts = [int(v) for v in value.split(",")]
    except ValueError:
        counts = []
    if not counts or any(c <= 0 for c in counts):
        raise argparse.ArgumentTypeError(f"expected positive counts such as 100,10000; got {value!r}")
    return counts


def _modes(value: str) -> list[str]:
    modes = value.split(",")
    if not modes or any(m not in ("sync", "async") for m in modes):
        raise argparse.ArgumentTypeError(f"expected sync, async or sync,async; got {value!r}")
    return modes


def _positive(convert: Callable[[str], float], what: str) -> Callable[[str], float]:
    """An argparse type: ``convert(value)`` if it is greater than zero."""

    def parse(value: str) -> float:
        try:
            x = convert(value)
        except ValueError:
            x = 0
        if not x > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {what}, got {value!r}")
        return x

    return parse


_positive_int = _positive(int, "integer")
_positive_float = _positive(float, "number")


def _bench_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="model directory (default: the tiny model in the user cache)")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    p.add_argument("--plot", metavar="PNG", help="write the plot to PNG (needs matplotlib)")
    p.add_argument("--quick", action="store_true", help="a short run, for CI")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenpace",
        description="Per-user output-token pacing for vLLM, and a fair multi-tenant gateway.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser(
        "serve",
        help="vLLM's OpenAI server with per-user output pacing (tokenpace serve --help)",
        add_help=False,
    )

    sub.add_parser("gateway", help="the tenant gateway (tokenpace gateway --help)", add_help=False)
    sub.add_parser("up", help="paced engines and the gateway together (tokenpace up --help)",
                   add_help=False)
    sub.add_parser("usage", help="usage totals from the gateway's ledger (tokenpace usage "
                   "--help); usage reconcile: the ledger against the engines", add_help=False)

    tiny = sub.add_parser(
        "tiny-model",
        help="write a deterministic tiny Llama model that vLLM loads on the CPU",
        description="Write a tiny random-weight Llama model (byte-level BPE tokenizer, chat "
        "template) into DIR. Does nothing if DIR already holds it; refuses a DIR that holds "
        "anything else.",
    )
    tiny.add_argument("dir", metavar="DIR")
    tiny.add_argument("--force", action="store_true", help="rewrite a previous tiny model")
    tiny.set_defaults(func=_cmd_tiny_model)

    bench = sub.add_parser("bench", help="measurements against stock vLLM in the same run")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    sched = bench_sub.add_parser(
        "scheduler",
        help="CPU time per step of schedule() + update_from_output(), stock vs paced",
        description="Times vLLM's real scheduler with R resident decoding requests, stock "
        "and paced, with a fraction of the users throttled.",
    )
    _bench_common(sched)
    sched.add_argument("--running", type=_int_list, default=[64, 256, 1024],
                       help="resident request counts (default 64,256,1024)")
    sched.add_argument("--throttled", type=_fraction_list, default=[0.0, 0.5, 1.0],
                       help="throttled fractions of users (default 0,0.5,1)")
    sched.add_argument("--steps", type=_positive_int, default=200, help="timed steps per run")
    sched.add_argument("--repeats", type=_positive_int, default=3,
                       help="alternating runs per case")
    sched.add_argument("--spec-tokens", type=int, default=0, metavar="K",
                       help="speculative decoding: K drafts per decode step, 70%% of them "
                       "accepted in turn (default 0: off)")
    sched.set_defaults(func=_cmd_bench_scheduler)

    pac = bench_sub.add_parser(
        "pacing",
        help="the seed's experiment: measured rates and token gaps on a real server",
        description="A 20 tok/s user with 1 and with 4 streams next to a 100 tok/s user on "
        "tokenpace serve with the tiny model; rates at the engine and the client.",
    )
    _bench_common(pac)
    pac.add_argument("--tokens", type=_positive_int, default=200, help="tokens per stream")
    pac.add_argument("--modes", type=_modes, default=["sync", "async"],
                     help="scheduling modes (default sync,async)")
    pac.add_argument("--serve-flags", default="", metavar="FLAGS",
                     help="more vllm serve flags for the engines, as one string (e.g. "
                     "--serve-flags \"--speculative-config '{...}'\"): the experiment in "
                     "another engine mode")
    pac.set_defaults(func=_cmd_bench_pacing)

    ovh = bench_sub.add_parser(
        "overhead",
        help="output tokens/s of tokenpace serve vs stock vLLM, limits never reached",
    )
    _bench_common(ovh)
    ovh.add_argument("--streams", type=_positive_int, default=32, help="concurrent streams")
    ovh.add_argument("--tokens", type=_positive_int, default=256, help="tokens per stream")
    ovh.add_argument("--repeats", type=_positive_int, default=6, help="alternating runs")
    ovh.set_defaults(func=_cmd_bench_overhead)

    idl = bench_sub.add_parser(
        "idle", help="server CPU while every request is throttled (sync, async, and without idle wait)",
    )
    _bench_common(idl)
    idl.add_argument("--window", type=_positive_float, default=10.0,
                     help="measurement window in seconds (default 10)")
    idl.set_defaults(func=_cmd_bench_idle)

    gwb = bench_sub.add_parser(
        "gateway", help="latency and throughput the gateway adds, against the engine direct",
    )
    _bench_common(gwb)
    gwb.add_argument("--requests", type=_positive_int, default=200,
                     help="pairs of sequential streamed requests (direct, gateway; default 200)")
    gwb.add_argument("--tokens", type=_positive_int, default=16,
                     help="tokens per sequential request (default 16)")
    gwb.add_argument("--streams", type=_positive_int, default=32,
                     help="concurrent streams in the throughput rounds (default 32)")
    gwb.add_argument("--stream-tokens", type=_positive_int, default=128,
                     help="tokens per concurrent stream (default 128)")
    gwb.add_argument("--rounds", type=_positive_int, default=24,
                     help="pairs of burst rounds (direct, gateway; default 24)")
    gwb.add_argument("--state", choices=("memory", "redis"), default="memory",
                     help="redis: also measure the same gateway with its state in Redis, as a "
                     "third path in the same pairs (starts a redis-server for the run unless "
                     "--redis is given; default memory: the in-process gateway only)")
    gwb.add_argument("--redis", metavar="URL", default=None,
                     help="an existing Redis for --state redis (implies it); its CPU is read "
                     "with INFO, so it should serve nothing else meanwhile")
    gwb.add_argument("--control", choices=["byte-proxy"], default=None,
                     help="add a control path to every pair: the engine behind a byte relay "
                          "in its own process (what any second process on the path costs)")
    gwb.set_defaults(func=_cmd_bench_gateway)

    fair = bench_sub.add_parser(
        "fairness",
        help="the VTC paper's workloads through the gateway: FCFS against VTC",
        description="Two tenants per workload (overloaded at request rates 1:2; a flood "
        "beside an on/off tenant; short against long requests) through two gateways that "
        "differ only in dispatch_order (fcfs, vtc), in front of one engine; with --replicas "
        "each gateway also runs as N replicas sharing a redis-server.",
    )
    _bench_common(fair)
    fair.add_argument("--duration", type=_positive_float, default=90.0,
                      help="seconds of arrivals per workload and policy (default 90)")
    fair.add_argument("--period", type=_positive_float, default=15.0,
                      help="length of the on/off tenant's off and on phases (default 15 s)")
    fair.add_argument("--window", type=_positive_float, default=5.0,
                      help="window over which service rates are compared (default 5 s)")
    fair.add_argument("--max-inflight", type=_positive_int, default=16,
                      help="requests each gateway keeps on the engine (default 16)")
    fair.add_argument("--calibration", type=_positive_float, default=15.0,
                      help="seconds of the capacity measurement (default 15)")
    fair.add_argument("--seed", type=int, default=1, help="seed of the arrival times")
    fair.add_argument("--replicas", type=_int_list, default=[1], metavar="N[,N...]",
                      help="run each policy's gateway as N replicas sharing a redis-server "
                      "started for the run, the requests spread round robin; several counts "
                      "(e.g. 1,2) each run every workload (default 1: one in-process gateway)")
    fair.set_defaults(func=_cmd_bench_fairness)

    flt = bench_sub.add_parser(
        "fleet",
        help="a 2-engine pool behind the gateway: against the engines directly, pool "
        "routing against pinned",
        description="Three engines on the tiny model under two names (2 x tiny, 1 x "
        "tiny-code) and two gateways (routing: pool and pinned): a lone tenant's throughput "
        "against the pool's engines driven directly, the shares of two and three backlogged "
        "tenants, a paced tenant whose rate is split over both engines (even and uneven "
        "streams, measured at the engines' event logs), and the CPU cost of the engine "
        "choice per request.",
    )
    _bench_common(flt)
    flt.add_argument("--duration", type=_positive_float, default=20.0,
                     help="seconds per round and path (default 20)")
    flt.add_argument("--warmup", type=_positive_float, default=4.0,
                     help="first seconds of a round left uncounted (default 4)")
    flt.add_argument("--rounds", type=_positive_int, default=3,
                     help="rounds, the order of the paths changing (default 3)")
    flt.add_argument("--streams", type=_positive_int, default=16,
                     help="closed-loop streams per tenant (default 16)")
    flt.add_argument("--max-inflight", type=_positive_int, default=8,
                     help="requests the gateway keeps on each engine (default 8)")
    flt.add_argument("--tokens", type=_positive_int, default=64,
                     help="output tokens per request (default 64)")
    flt.add_argument("--paced-rate", type=_positive_float, default=80.0,
                     help="the paced tenant's output_tokens_per_second (default 80)")
    flt.add_argument("--paced-seconds", type=_positive_float, default=10.0,
                     help="about how long each paced scenario's streams run (default 10)")
    flt.add_argument("--workload", choices=("streams", "conversations"), default="streams",
                     help="streams: the measurements above (default); conversations: "
                     "multi-turn conversations over 2 engines with prefix caching, each sent "
                     "straight to one engine against the gateway's locality: tenant and "
                     "locality: conversation (prefix-cache hit rate, TTFT, turns/s), two "
                     "tenants' shares, the choice's cost per request")
    flt.set_defaults(func=_cmd_bench_fleet)

    bat = bench_sub.add_parser(
        "batch",
        help="a large batch (/v1/batches) beside live requests on the same engine: live "
        "TTFT and req/s with and without it, the batch's throughput against the engine "
        "alone, two tenants' batches by weight",
        description="One engine on the tiny model (--max-num-seqs 16, priority scheduling) "
        "behind one gateway (lanes interactive and batch, batch.headroom 1). In rounds, the "
        "order of the phases changing: a live tenant's open-loop Poisson requests alone and "
        "while a large batch runs (time to first token p50 and p99, requests/s; goals: p50 "
        "within 1.2x, requests/s unchanged); a batch alone against the same requests sent "
        "straight to the engine by 16 clients (output tokens/s; goal >= 0.8); two tenants' "
        "batches at once, weights 2 and 1 (goal: shares 2/3 and 1/3). The engine runs on "
        "half of the cores, the gateway and the load on the others (--layout).",
    )
    _bench_common(bat)
    bat.add_argument("--duration", type=_positive_float, default=20.0,
                     help="seconds per phase and round (default 20)")
    bat.add_argument("--warmup", type=_positive_float, default=4.0,
                     help="first seconds of a phase left uncounted (default 4)")
    bat.add_argument("--rounds", type=_positive_int, default=3,
                     help="rounds, the order of the phases changing (default 3)")
    bat.add_argument("--rate", type=_positive_float, default=4.0,
                     help="the live tenant's Poisson arrivals, requests/s (default 4)")
    bat.add_argument("--tokens", type=_positive_int, default=32,
                     help="output tokens per request, live and batch line (default 32)")
    bat.add_argument("--headroom", type=int, default=1,
                     help="batch.headroom: of the engine's 16 slots, those batch lines never "
                     "take (default 1)")
    bat.add_argument("--layout", choices=("split", "shared"), default="split",
                     help="split: the engine on half of the cores, the gateway and the load "
                     "on the others, as on separate machines (default); shared: vLLM's own "
                     "binding, its processes beside the gateway's on the same cores (on 2 "
                     "cores the busy engine then keeps the gateway waiting for a core)")
    bat.set_defaults(func=_cmd_bench_batch)

    fov = bench_sub.add_parser(
        "failover",
        help="an engine of a 2-engine pool killed under load and started again",
        description="Two engines on the tiny model in one pool behind the gateway, clients "
        "streaming without pause; one engine's process group gets SIGKILL, then it is started "
        "again on its port. Reports the requests failed (in flight on the dead engine, or "
        "never reached it), how long the gateway kept dispatching to it, how soon the "
        "restarted engine took traffic, and the ledger against what the clients received.",
    )
    _bench_common(fov)
    fov.add_argument("--kill-after", type=_positive_float, default=10.0,
                     help="seconds of load before the kill (default 10)")
    fov.add_argument("--down-for", type=_positive_float, default=10.0,
                     help="seconds between the kill and the restart (default 10)")
    fov.add_argument("--after-back", type=_positive_float, default=15.0,
                     help="seconds of load after the restarted engine answers (default 15)")
    fov.add_argument("--streams", type=_positive_int, default=8,
                     help="clients streaming without pause (default 8)")
    fov.add_argument("--tokens", type=_positive_int, default=24,
                     help="output tokens per request (default 24)")
    fov.add_argument("--max-inflight", type=_positive_int, default=4,
                     help="requests the gateway keeps on each engine (default 4)")
    fov.add_argument("--restart-timeout", type=_positive_float, default=600.0,
                     help="seconds to wait for the restarted engine (default 600)")
    fov.set_defaults(func=_cmd_bench_failover)

    met = bench_sub.add_parser(
        "metering",
        help="the usage ledger against the engines' own counts, through gateway SIGKILLs "
        "and a Postgres outage",
        description="Two engines on the tiny model in one pool behind the gateway, its "
        "ledger in a throwaway PostgreSQL (initdb and postgres must be installed) with a "
        "journal on disk; three paced tenants stream and call chat and completions, some "
        "clients leaving mid-stream. The gateway is SIGKILLed --kills times and started "
        "again at once, Postgres is stopped for --outage seconds, and a NUL and a 6 MiB "
        "model name are sent. At the end, per tenant, the ledger's completion tokens "
        "against what the engines counted (their event logs, and their books of ended "
        "requests), and per request: ids with no row, counts that differ, ids twice, "
        "estimated and dead-letter rows.",
    )
    _bench_common(met)
    met.add_argument("--duration", type=_positive_float, default=80.0,
                     help="seconds of load (default 80)")
    met.add_argument("--kills", type=int, default=3, choices=range(0, 21), metavar="N",
                     help="gateway SIGKILLs, evenly spaced through the load (default 3)")
    met.add_argument("--outage", type=float, default=20.0, metavar="S",
                     help="seconds Postgres is stopped, from halfway between the first kill "
                     "and the next on (default 20; 0: none)")
    met.add_argument("--loops", type=_positive_int, default=4,
                     help="client loops per tenant, each sending without pause (default 4)")
    met.add_argument("--seed", type=int, default=1, help="seed of the clients' choices")
    met.add_argument("--gateway-src", type=Path, default=None, metavar="DIR",
                     help="run the gateway from this source tree (the src/ directory of "
                     "another checkout, e.g. an older commit's worktree; PYTHONPATH=DIR); "
                     "the engines stay this installation's")
    met.set_defaults(func=_cmd_bench_metering)

    hos = bench_sub.add_parser(
        "hostile",
        help="one hostile tenant's attacks against another tenant's ordinary requests, "
        "with the gateway's default limits",
        description="A gateway with the default limits (two tenants, one engine on the tiny "
        "model, a SQLite ledger). A victim tenant sends short chat requests at a steady rate, "
        "alone, then beside each attack in turn (a fresh gateway each): a parse bomb, batch "
        "uploads, a tokenize flood, slow readers, huge model names, slowloris, a connection "
        "flood. Per attack: the victim's p50/p99 latency against its own baseline, its "
        "errors, the gateway's memory growth, the ledger's growth and the victim's rows, "
        "what the attacker got. --quick: shorter phases and smaller attacks.",
    )
    _bench_common(hos)
    hos.add_argument("--duration", type=_positive_float, default=None,
                     help="seconds of each attack, and of the baseline phase (default 15; "
                     "--quick: 5)")
    hos.add_argument("--baseline", type=_positive_float, default=None,
                     help="seconds of the victim alone before each attack (default 8; "
                     "--quick: 4)")
    hos.add_argument("--rate", type=_positive_float, default=8.0,
                     help="the victim's requests per second (default 8)")
    hos.add_argument("--victim-timeout", type=_positive_float, default=30.0,
                     help="seconds each victim request may take (default 30)")
    hos.add_argument("--attacks", type=lambda v: [a for a in v.split(",") if a],
                     default=None, metavar="NAME[,NAME...]",
                     help="the attacks to run (default all: parse_bomb, batch_uploads, "
                     "tokenize_flood, slow_readers, huge_model_names, slowloris, "
                     "connection_flood)")
    hos.add_argument("--engine-url", default=None, metavar="URL",
                     help="use this running engine (its first served model) instead of "
                     "starting the tiny model")
    hos.add_argument("--gateway-src", type=Path, default=None, metavar="DIR",
                     help="run the gateway from this source tree (the src/ directory of "
                     "another checkout; PYTHONPATH=DIR)")
    hos.set_defaults(func=_cmd_bench_hostile)

    stb = bench_sub.add_parser(
        "state", help="state work per request: Redis (several replicas) against in process",
    )
    _bench_common(stb)
    stb.add_argument("--requests", type=_positive_int, default=2000,
                     help="requests per measurement (default 2000)")
    stb.add_argument("--concurrency", type=_positive_int, default=32,
                     help="requests at once in the throughput measurement (default 32)")
    stb.add_argument("--repeats", type=_positive_int, default=5,
                     help="alternating repeats per store (default 5)")
    stb.add_argument("--redis", metavar="URL", default=None,
                     help="an existing Redis (default: start a redis-server for the run)")
    stb.set_defaults(func=_cmd_bench_state)

    tnb = bench_sub.add_parser(
        "tenants", help="gateway cost against the number of configured tenants (fast upstream)",
    )
    _bench_common(tnb)
    tnb.add_argument("--configured", type=_counts, default=[100, 10000],
                     help="tenant counts to configure, one gateway each (default 100,10000; "
                     "the first is the baseline of the CPU ratio)")
    tnb.add_argument("--active", type=_positive_int, default=100,
                     help="tenants that send the load, the same in every arm (default 100)")
    tnb.add_argument("--requests", type=_positive_int, default=3000,
                     help="streamed requests per repeat (default 3000)")
    tnb.add_argument("--clients", type=_positive_int, default=256,
                     help="concurrent clients (default 256)")
    tnb.add_argument("--repeats", type=_positive_int, default=3,
                     help="load repeats and fresh start-ups per arm (default 3)")
    tnb.add_argument("--events", type=_positive_int, default=5,
                     help="scrapes and reloads timed against a probe request (default 5 each)")
    tnb.add_argument("--format", choices=("yaml", "json"), default="yaml",
                     help="how the configuration file is written (default yaml)")
    tnb.set_defaults(func=_cmd_bench_tenants)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["serve"]:
        # Not argparse: every vllm serve flag must pass through untouched.
        from . import serve

        return int(serve.main(args_list[1:]))
    if args_list[:1] == ["gateway"]:
        from .gateway.server import main as gateway_main

        return gateway_main(args_list[1:])
    if args_list[:1] == ["up"]:
        from . import up

        return up.main(args_list[1:])
    if args_list[:2] == ["usage", "reconcile"]:
        from .gateway.reconcile import reconcile_main

        return reconcile_main(args_list[2:])
    if args_list[:1] == ["usage"]:
        from .gateway.ledger import usage_main

        return usage_main(args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
