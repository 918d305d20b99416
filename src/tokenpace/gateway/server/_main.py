"""``tokenpace gateway --config gateway.yaml``: serve the gateway with uvicorn.

The configuration is validated before the server binds its port, so a bad file stops the
command at once with the key named. SIGHUP re-reads the file like ``POST /admin/reload``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Coroutine
from typing import Any

from ..._redact import install_log_redaction
from ..config import ConfigError, GatewayConfig, load_config
from ._secrets import register_secrets
from ..state import check_workers
from ._workers import WORKER_FLAG, reuse_port_socket, supervise, worker_argv

logger = logging.getLogger("tokenpace.gateway")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenpace gateway",
        description="OpenAI-compatible gateway: API keys -> tenants, admission, token "
                    "budgets, fair dispatch to vLLM engines, usage ledger, Prometheus metrics.",
    )
    parser.add_argument("--config", required=True, metavar="FILE",
                        help="gateway YAML file (see docs/gateway/configuration.md)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="gateway processes serving the port (default 1); more than one "
                             "needs the configuration key 'state' (shared budgets in Redis)")
    parser.add_argument(WORKER_FLAG, type=int, default=None, help=argparse.SUPPRESS)
    return parser


def load_or_exit(parser: argparse.ArgumentParser, path: str, log_level: str) -> GatewayConfig:
    """The validated configuration, or a usage error naming the key; then set up logging."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        parser.error(f"argument --config: {exc}")
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Every record of the process, uvicorn's included, without passwords and keys.
    install_log_redaction()
    register_secrets(config)
    # httpx logs every upstream request at INFO: the access log already shows each request.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    return config


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = load_or_exit(parser, args.config, args.log_level)
    problem = check_workers(args.workers, config.state)
    if problem is not None:
        parser.error(problem)
    if args.workers > 1:
        return supervise(worker_argv(argv), args.workers)
    return run_loop(serve(config, args.host, args.port, args.log_level,
                          workers=args.worker_of or 1))


def run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop when it is installed (the ``gateway`` extra installs it): its event
    loop and transports cost a fraction of asyncio's per read and write. ``asyncio.run``
    would bypass uvicorn's own loop choice, which only ``uvicorn.run`` applies."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


CLIENT_KEEP_ALIVE_S = 75
"""How long an idle client connection stays open. HTTP clients keep idle connections for
a few seconds (httpx and the openai SDK: 5 s) and reuse them without asking; if the server
closes at the same moment the client's request fails with a connection error. Closing
well after the clients do (uvicorn's default is 5 s) avoids that race."""


def _http_protocol(config: GatewayConfig) -> type:
    """uvicorn's httptools protocol (a C HTTP parser) with the configuration's deadlines
    for headers and bodies and its connection limit (``_protocol``)."""
    from ._protocol import ConnectionLimits, guarded_protocol

    return guarded_protocol(ConnectionLimits(
        header_timeout_s=config.header_timeout_s, body_timeout_s=config.body_timeout_s,
        body_min_rate=config.body_min_rate, max_connections=config.max_connections))


FD_HEADROOM = 256
"""File descriptors kept beside the client connections: engines' connections, the ledger,
the journal, the state store."""


def _raise_fd_limit(max_connections: int) -> None:
    """Raise the process's soft limit on open files towards ``max_connections`` plus
    ``FD_HEADROOM`` (up to the hard limit): past it ``accept`` fails instead of answering
    the connection limit's 503. Warns when the hard limit is lower."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            target = soft
        if target < wanted:
            logger.warning("max_connections is %d but this process may open only %d files "
                           "(ulimit -n): raise the limit or lower max_connections",
                           max_connections, target)


SWITCH_INTERVAL_S = 0.001


async def serve(config: GatewayConfig, host: str, port: int, log_level: str,
                workers: int = 1) -> int:
    """Serve until SIGINT/SIGTERM; SIGHUP reloads the configuration file. ``workers > 1``:
    one of that many processes sharing the port (SO_REUSEPORT) and the state store."""
    import uvicorn

    from ._app import Gateway

    # Worker threads share the GIL with the event loop: a reload reads its file in one, the
    # ledger writes in one. Each time the loop wakes up (a socket is ready) while one of them
    # runs, it waits up to this interval for the GIL; a request wakes it several times.
    # 1 ms hands the GIL back five times sooner than Python's default 5 ms, at the cost of
    # more switches only while two threads want it (docs/benchmarks/tenants.md measures
    # what the default added to a request).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    gateway = Gateway(config)
    gateway.workers = workers
    server = uvicorn.Server(uvicorn.Config(
        gateway.app, host=host, port=port, log_level=log_level, lifespan="on",
        timeout_graceful_shutdown=30, timeout_keep_alive=CLIENT_KEEP_ALIVE_S,
        http=_http_protocol(config),
    ))
    _raise_fd_limit(config.max_connections)

    reloads: set[asyncio.Task[None]] = set()

    async def reload() -> None:
        try:
            await gateway.reload_async()  # read off the event loop, as POST /admin/reload
        except ConfigError as exc:
            logger.error("reload refused, the old configuration stays: %s", exc)

    def on_sighup() -> None:
        task = loop.create_task(reload())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGHUP, on_sighup)
    except (NotImplementedError, AttributeError):  # not on this platform
        pass
    await server.serve(sockets=[reuse_port_socket(host, port)] if workers > 1 else None)
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
