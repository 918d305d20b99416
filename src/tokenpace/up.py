"""``tokenpace up``: paced engines and the gateway in front of them, with one command.

For each engine of the gateway configuration whose URL is on this machine, start
``tokenpace serve MODEL --trusted-gateway --port P`` (so tenants' rates travel with their
requests), wait until it answers, then serve the gateway in this process. Engines log to
files next to the configuration; they stop when the gateway stops.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from urllib.parse import urlsplit

from .gateway._config import GatewayConfig

LOCAL_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::1")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenpace up",
        description="Start paced vLLM engines for the local engine URLs of a gateway "
                    "configuration, then the gateway in front of them.",
        epilog="Arguments after -- go to every `tokenpace serve` (any vllm serve flag).",
    )
    parser.add_argument("model", metavar="MODEL", help="model for the engines (path or name)")
    parser.add_argument("--config", required=True, metavar="FILE", help="gateway YAML file")
    parser.add_argument("--host", default="127.0.0.1", help="gateway address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients use (passed to the engines)")
    return parser


def engine_argv(model: str, port: int, served_name: str | None, extra: list[str],
                policy: str = "fcfs") -> list[str]:
    argv = [sys.executable, "-m", "tokenpace.cli", "serve", model, "--trusted-gateway",
            "--host", "127.0.0.1", "--port", str(port), "--scheduling-policy", policy]
    if served_name:
        argv += ["--served-model-name", served_name]
    return argv + extra


def local_engines(config: GatewayConfig) -> list[tuple[int, str]]:
    """(port, scheduling policy) of each engine this command should start."""
    found = []
    for engine in config.engines:
        parts = urlsplit(engine.url)
        if parts.hostname in LOCAL_HOSTS and parts.port:
            found.append((parts.port, engine.scheduling_policy))
    return found


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
    from .gateway._main import load_or_exit

    config = load_or_exit(parser, args.config, "info")
    from .bench._server import Server, start_all
    from .serve import ServeUsageError, build_command

    try:
        build_command([args.model, "--trusted-gateway", *extra])
    except ServeUsageError as exc:
        parser.error(f"engine flags after --: {exc}")
    log_dir = Path(args.config).resolve().parent
    servers = []
    for port, policy in local_engines(config):
        log = log_dir / f"tokenpace-engine-{port}.log"
        print(f"starting engine on port {port} (log: {log}) ...", flush=True)
        argv = engine_argv(args.model, port, args.served_model_name, extra, policy)
        servers.append(Server(argv, port, log))
    # uvicorn re-raises SIGTERM/SIGINT once it has shut down; turning them into SystemExit
    # here lets the finally clause below stop the engines (they run in their own sessions).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        start_all(servers)
        model = args.served_model_name or args.model
        print(usage_text(config, args.host, args.port, model), flush=True)
        from .gateway._main import serve

        return asyncio.run(serve(config, args.host, args.port, "info"))
    except KeyboardInterrupt:
        return 130
    finally:
        for server in servers:
            server.stop()
