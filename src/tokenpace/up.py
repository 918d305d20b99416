"""``tokenpace up``: paced engines and the gateway in front of them, with one command.

For each engine of the gateway configuration whose URL is on this machine, start
``tokenpace serve MODEL --trusted-gateway --port P`` (so tenants' rates travel with their
requests), wait until it answers, then serve the gateway in this process. Engines log to
files next to the configuration; they stop when the gateway stops.

Each engine gets an API key (the configuration's ``engines[].api_key``, or a random one
made here) through the ``VLLM_API_KEY`` environment variable, never the command line
(which every local user can read in ``ps``); the gateway sends the same key. An engine
whose API server dies has its whole process group stopped at once, so its engine-core
processes do not live on holding memory.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
from dataclasses import dataclass
import secrets
import signal
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

from ._process import with_prompt_tokens_details
from .gateway.config import GatewayConfig

ENGINE_WATCH_INTERVAL_S = 1.0

LOCAL_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::1")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenpace up",
        description="Start paced vLLM engines for the local engine URLs of a gateway "
                    "configuration, then the gateway in front of them.",
        epilog="Arguments after -- go to every `tokenpace serve` (any vllm serve flag).",
    )
    parser.add_argument("model", metavar="MODEL", nargs="?", default=None,
                        help="model for the engines without engines[].model_path (path or name)")
    parser.add_argument("--config", required=True, metavar="FILE", help="gateway YAML file")
    parser.add_argument("--host", default="127.0.0.1", help="gateway address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients use, for engines without engines[].models")
    return parser


def engine_argv(model: str, port: int, served_names: list[str], extra: list[str],
                policy: str = "fcfs") -> list[str]:
    """``tokenpace serve`` for one local engine. The engine reports cached prompt tokens
    (``--enable-prompt-tokens-details``, unless ``extra`` already says either way) so the
    gateway can charge them at ``cost.cached_prompt``."""
    argv = [sys.executable, "-m", "tokenpace.cli", "serve", model, "--trusted-gateway",
            "--host", "127.0.0.1", "--port", str(port), "--scheduling-policy", policy]
    if served_names:
        argv += ["--served-model-name", *served_names]
    return argv + with_prompt_tokens_details(extra)


@dataclass(frozen=True)
class LocalEngine:
    """An engine of the configuration that this command starts, and what it serves."""

    port: int
    policy: str
    model: str  # path or hub name
    served_names: list[str]  # its --served-model-name (empty: vLLM's default, the model)


def plan_engines(config: GatewayConfig, model: str | None,
                 served_name: str | None) -> list[LocalEngine]:
    """What to start for each local engine: ``engines[].model_path`` (relative to the
    configuration's folder) or ``model``; ``engines[].models`` as its served names, else
    ``served_name``. Raises ``ValueError`` naming an engine that has no model."""
    base = config.source.resolve().parent if config.source is not None else Path.cwd()
    plan = []
    for i, engine in enumerate(config.engines):
        parts = urlsplit(engine.url)
        if parts.hostname not in LOCAL_HOSTS or not parts.port:
            continue
        path = engine.model_path
        if path is not None and (base / path).exists():
            path = str(base / path)
        chosen = path or model
        if chosen is None:
            raise ValueError(f"engines[{i}] ({engine.url}): no model to serve; give MODEL or "
                             "engines[].model_path")
        names = list(engine.models) if engine.models is not None else (
            [served_name] if served_name else [])
        plan.append(LocalEngine(parts.port, engine.scheduling_policy, chosen, names))
    return plan


CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_binds(engines: int, cores: list[int], cpu_vllm: bool,
              environ: dict[str, str] | None = None) -> list[str | None]:
    """The CPU cores each of ``engines`` local CPU engines computes on.

    vLLM-cpu's ``auto`` binding gives every engine of a host the same core (the last
    physical core of its NUMA node), so engines started side by side would share one core.
    Each gets a slice of ``cores`` of its own instead (a core each, round robin, when there
    are more engines than cores). None: leave vLLM's own choice (the GPU package, one
    engine, or the operator set the variable).
    """
    env = os.environ if environ is None else environ
    if not cpu_vllm or engines < 2 or CPU_BIND_ENV in env or not cores:
        return [None] * engines
    if engines > len(cores):
        return [str(cores[i % len(cores)]) for i in range(engines)]
    out = []
    for i in range(engines):
        part = cores[i * len(cores) // engines:(i + 1) * len(cores) // engines]
        out.append(",".join(str(c) for c in part))
    return out


def local_engines(config: GatewayConfig) -> list[tuple[int, str]]:
    """(port, scheduling policy) of each engine this command should start."""
    found = []
    for engine in config.engines:
        parts = urlsplit(engine.url)
        if parts.hostname in LOCAL_HOSTS and parts.port:
            found.append((parts.port, engine.scheduling_policy))
    return found


def with_engine_keys(config: GatewayConfig) -> GatewayConfig:
    """The configuration with an API key for every engine this command starts.

    A key given in the file is kept (an operator may want to call the engine too);
    otherwise a random 256-bit one is made for this run.
    """
    local = {port for port, _ in local_engines(config)}
    engines = tuple(
        dataclasses.replace(e, api_key=e.api_key or secrets.token_urlsafe(32))
        if urlsplit(e.url).port in local and urlsplit(e.url).hostname in LOCAL_HOSTS else e
        for e in config.engines)
    return dataclasses.replace(config, engines=engines)


def engine_key(config: GatewayConfig, port: int) -> str:
    """The key of the local engine on ``port``."""
    return next(e.api_key for e in config.engines if e.api_key is not None
                and urlsplit(e.url).port == port and urlsplit(e.url).hostname in LOCAL_HOSTS)


def watch_engines(servers: list, stop: threading.Event) -> threading.Thread:
    """Stop the process group of an engine whose API server exited (killed or crashed)."""

    def run() -> None:
        reaped: set[int] = set()
        while not stop.wait(ENGINE_WATCH_INTERVAL_S):
            for server in servers:
                if server.port not in reaped and server.exited():
                    reaped.add(server.port)
                    print(f"engine on port {server.port} exited (code {server.proc.returncode});"
                          f" stopping its remaining processes. Log: {server.log_path}",
                          file=sys.stderr, flush=True)
                    server.stop()

    thread = threading.Thread(target=run, name="tokenpace-engine-watch", daemon=True)
    thread.start()
    return thread


def usage_text(config: GatewayConfig, host: str, port: int, model: str) -> str:
    key = "<a tenant API key from the configuration>"
    url = f"http://{host}:{port}"
    return f"""
tokenpace gateway on {url}, {len(config.tenants)} tenant(s): {', '.join(t.id for t in config.tenants)}

  curl -s {url}/v1/chat/completions -H 'authorization: Bearer {key}' \\
    -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 50}}'

  python -c 'import openai; c = openai.OpenAI(base_url="{url}/v1", api_key="{key}");
  print(c.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hi"}}],
        max_tokens=50).choices[0].message.content)'

  metrics: {url}/metrics   usage so far: tokenpace usage --config {config.source}
"""


def main(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    from .gateway.server import load_or_exit

    config = load_or_exit(parser, args.config, "info")
    from ._process import Server, start_all
    from .serve import ServeUsageError, build_command

    if any(a == "--api-key" or a.startswith(("--api-key=", "--api_key")) for a in extra):
        parser.error("engine flags after --: give the engines' key as engines[].api_key in "
                     "the configuration (or leave it out: one is generated), not --api-key")
    try:
        plan = plan_engines(config, args.model, args.served_model_name)
    except ValueError as exc:
        parser.error(str(exc))
    for model in sorted({engine.model for engine in plan}):
        try:  # the engines' keys are made below; check the other flags now
            build_command([model, "--trusted-gateway", *extra],
                          environ={"VLLM_API_KEY": "generated"})
        except ServeUsageError as exc:
            parser.error(f"engine flags after --: {exc}")
    config = with_engine_keys(config)
    log_dir = Path(args.config).resolve().parent
    servers = []
    from ._amx import CPU_DISTRIBUTION, is_installed

    binds = cpu_binds(len(plan), sorted(os.sched_getaffinity(0)), is_installed(CPU_DISTRIBUTION))
    for engine, bind in zip(plan, binds):
        log = log_dir / f"tokenpace-engine-{engine.port}.log"
        print(f"starting engine on port {engine.port} ({engine.model} as "
              f"{', '.join(engine.served_names) or engine.model}"
              f"{f'; cores {bind}' if bind else ''}; log: {log}) ...", flush=True)
        argv = engine_argv(engine.model, engine.port, engine.served_names, extra, engine.policy)
        env = {"VLLM_API_KEY": engine_key(config, engine.port)}
        if bind is not None:
            env[CPU_BIND_ENV] = bind
        servers.append(Server(argv, engine.port, log, env=env))
    # uvicorn re-raises SIGTERM/SIGINT once it has shut down; turning them into SystemExit
    # here lets the finally clause below stop the engines (they run in their own sessions).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    stop_watch = threading.Event()
    try:
        start_all(servers)
        watch_engines(servers, stop_watch)
        names = [n for e in plan for n in e.served_names or [e.model]]
        model = names[0] if names else (args.served_model_name or args.model or "MODEL")
        print(usage_text(config, args.host, args.port, model), flush=True)
        from .gateway.server import serve

        return asyncio.run(serve(config, args.host, args.port, "info"))
    except KeyboardInterrupt:
        return 130
    finally:
        stop_watch.set()
        for server in servers:
            server.stop()
