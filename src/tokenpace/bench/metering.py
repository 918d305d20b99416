"""`tokenpace bench metering`: the usage ledger against the engines, through faults.

Two engines on the tiny model (``tokenpace serve --trusted-gateway`` with an engine key and
``--output-rate-event-log``) serve ``tiny`` in one pool behind one gateway, whose ledger is
a throwaway PostgreSQL server started for the run, with ``ledger_journal`` on local disk.
Three paced tenants (``RATES`` output tokens/s) each run ``loops`` client loops without
pause: chat or completions, streamed or not, ``max_tokens`` drawn from ``MAX_TOKENS``,
``ignore_eos``; ``LEAVE_SHARE`` of the streams leave after a random number of chunks.

Faults during the ``duration`` seconds of load:

- the gateway gets SIGKILL ``kills`` times, evenly spaced (at ``duration * i / (kills + 1)``),
  and is started again at once on the same port, configuration and journal (a gateway that
  exits during start-up is started again until it answers);
- Postgres is stopped for ``outage`` seconds, from halfway between the first kill and the
  next one (or the end of the load) on;
- before the first kill, one request whose ``model`` is ``"\\u0000"`` and one whose model
  name is ``BIG_MODEL_CHARS`` characters long (under the gateway's 8 MiB body limit).

Routing is ``pool`` (the default) with an engine key, so the paced tenants' rates are
split over both engines and requests in flight at a kill sit on both: the restarted
gateway has to ask each engine about its own.

At the end every client leaves (what is in flight is cancelled), the bench waits until the
ledger's rows stop changing and the journal holds no unwritten row, stops the gateway with
SIGTERM and reads everything. The engines' counts, for requests whose engine request id
carries the gateway's id (``tpg-...``), per engine user (the tenant), are taken twice:

- *event logs* (:func:`tokenpace.engine.read_charges`): one charge per sampling step
  dispatched for the request;
- *engine books*: the output tokens the engine counted when the request ended, as
  ``POST /tokenpace/v1/aborted`` answers them (what a gateway can learn).

They differ by one token for a request aborted while a step of it was running: vLLM ends
aborted requests before it takes that step's output, so the token was computed (and
charged to the pace) but never counted or sent (``aborted_with_a_step_in_flight``).

Reported, against each: per tenant, the engines' tokens against the ledger's completion
tokens of served rows; per request, ids the clients received (``x-request-id``) and
requests the engines ran with no row, and rows whose count differs; and ids twice, rows
marked ``estimated``, dead-letter rows, journal rows left unwritten, the two bad-model
requests' rows. ``exact_to_*`` is true when every tenant's two counts are equal and no
request is missing, differs or is twice.

``gateway_src`` runs the gateway from another source tree (an older commit: ``PYTHONPATH``
set to it); the engines stay this tree's. Optional keys that tree's configuration parser
refuses (``OPTIONAL_KEYS``) are left out, and the result says which.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .._process import PROMPT_TOKENS_DETAILS, Server, free_port, start_all, tokenpace_serve_argv
from ..engine import read_charges
from ..up import CPU_BIND_ENV, cpu_binds
from ._cli import add_common_args, bench_model, check_gateway_src, positive_float, positive_int
from ._cli import write_outputs
from ._environment import environment
from ._load import sse_payloads
from ._postgres_server import PostgresServer, PostgresUnavailable, psycopg
from ._postgres_server import missing as postgres_missing

ENGINE_KEY = "sk-bench-metering-engine"
RATES = {"tenant-a": 30.0, "tenant-b": 50.0, "tenant-c": 80.0}
MAX_TOKENS = (20, 150)
STREAM_SHARE = 0.7  # of requests, streamed
LEAVE_SHARE = 0.2  # of streams, left mid-stream by their client
BIG_MODEL_CHARS = 6 * 1024 * 1024
OPTIONAL_KEYS = ("ledger_journal",)
SETTLE_TIMEOUT_S = 120.0
LOST_WINDOW_S = 10.0  # requests with no row are told by when they ended, in such windows
RESTART_TIMEOUT_S = 300.0

__all__ = ["PostgresUnavailable", "add_cli_args", "main", "run"]
_REQUEST_ID = re.compile(r"tpg-[0-9a-f]{32}")


@dataclass
class Call:
    """One request as its client saw it."""

    tenant: str
    kind: str  # "chat" or "completion"
    stream: bool
    max_tokens: int
    leave_after: int | None  # chunks after which the client leaves (streams only)
    request_id: str = ""  # the gateway's x-request-id, when an answer came
    status: int = 0
    chunks: int = 0
    left: bool = False
    error: str | None = None


@dataclass
class Faults:
    """What was done when, in seconds from the start of the load."""

    kills: list[dict[str, Any]] = field(default_factory=list)
    outage: dict[str, float] = field(default_factory=dict)
    bad_models: list[dict[str, Any]] = field(default_factory=list)
    t0: float = 0.0  # the start of the load (time.monotonic(), the engines' clock too)


def _key(tenant: str) -> str:
    return f"sk-bench-metering-{tenant}"


def _gateway_config(urls: Sequence[str], ledger: str, journal: Path) -> dict[str, Any]:
    return {
        "engines": [{"url": u, "api_key": ENGINE_KEY, "models": ["tiny"], "max_inflight": 16}
                    for u in urls],
        "routing": "pool",
        "ledger": ledger,
        "ledger_journal": str(journal),
        "tenants": [{"id": t, "api_keys": [_key(t)], "output_tokens_per_second": rate,
                     "queue_timeout": "5m"} for t, rate in RATES.items()],
    }


_PROBE = """
import json, re, sys
from tokenpace.gateway.config import ConfigError, parse_config
data, optional, dropped = json.load(sys.stdin), set(sys.argv[1:]), []
while True:
    try:
        parse_config(data)
        break
    except ConfigError as exc:
        found = re.match(r"(\\w+): unknown key", str(exc))
        if found is None or found.group(1) not in optional:
            raise
        data.pop(found.group(1))
        dropped.append(found.group(1))
print(json.dumps(dropped))
"""


def _accepted(config: dict[str, Any], env: dict[str, str]) -> list[str]:
    """Drop from ``config`` the ``OPTIONAL_KEYS`` the gateway run with ``env`` refuses (its
    own parser decides, in a subprocess); the keys dropped."""
    done = subprocess.run([sys.executable, "-c", _PROBE, *OPTIONAL_KEYS],
                          input=json.dumps(config), capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"the gateway refuses the bench's configuration:\n{done.stderr}")
    dropped: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    for key in dropped:
        config.pop(key, None)
    return dropped


class _Gateway:
    """The gateway process, killed and started again on one port and configuration."""

    def __init__(self, home: Path, config: Path, env: dict[str, str]) -> None:
        self.home, self.config, self.env = home, config, env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.starts = 0
        self.server: Server | None = None

    def start(self, timeout_s: float = RESTART_TIMEOUT_S) -> float:
        """Start it and wait until it answers ``/health``; the seconds that took. A process
        that exits during start-up (a gateway that needs its database at start, during an
        outage) is started again until ``timeout_s`` passed."""
        began = time.monotonic()
        while True:
            self.starts += 1
            self.server = Server([sys.executable, "-m", "tokenpace.cli", "gateway", "--config",
                                  str(self.config), "--port", str(self.port),
                                  "--log-level", "warning"],
                                 self.port, self.home / f"gateway-{self.starts}.log", env=self.env)
            try:
                self.server.wait_ready(max(1.0, began + timeout_s - time.monotonic()))
                return time.monotonic() - began
            except RuntimeError:
                self.server.stop()
                if time.monotonic() - began > timeout_s:
                    raise
                time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILL to its process group, then reap it."""
        if self.server is not None:
            try:
                os.killpg(self.server.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.server.stop()

    def stop(self) -> None:
        """SIGTERM: the gateway's own shutdown, its last flush included."""
        if self.server is not None:
            self.server.stop()


def _body(call: Call, n: int) -> dict[str, Any]:
    text = f"Tell me about the sea, part {n}"
    body: dict[str, Any] = {"model": "tiny", "max_tokens": call.max_tokens, "ignore_eos": True,
                            "stream": call.stream}
    if call.kind == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if call.stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _send(session: aiohttp.ClientSession, url: str, call: Call, n: int) -> None:
    path = "/v1/chat/completions" if call.kind == "chat" else "/v1/completions"
    try:
        async with session.post(f"{url}{path}", json=_body(call, n),
                                headers={"authorization": f"Bearer {_key(call.tenant)}"}) as resp:
            call.status = resp.status
            call.request_id = resp.headers.get("x-request-id", "")
            if resp.status != 200 or not call.stream:
                await resp.read()
                return
            async for data in sse_payloads(resp.content.iter_any()):
                if data == b"[DONE]" or b'"choices":[]' in data:
                    continue
                call.chunks += 1
                if call.leave_after is not None and call.chunks >= call.leave_after:
                    call.left = True
                    resp.close()  # the client goes away mid-stream
                    return
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        call.error = f"{type(exc).__name__}: {exc}"


async def _loop(session: aiohttp.ClientSession, url: str, tenant: str, rng: random.Random,
                stop: asyncio.Event, calls: list[Call]) -> None:
    while not stop.is_set():
        stream = rng.random() < STREAM_SHARE
        max_tokens = rng.randint(*MAX_TOKENS)
        leave = rng.randint(1, max_tokens - 1) if stream and rng.random() < LEAVE_SHARE else None
        call = Call(tenant, rng.choice(("chat", "completion")), stream, max_tokens, leave)
        calls.append(call)
        await _send(session, url, call, len(calls))
        if call.status != 200:
            await asyncio.sleep(0.2)  # a refused client backs off a little, as SDKs do


async def _bad_models(session: aiohttp.ClientSession, url: str, faults: Faults,
                      t0: float) -> None:
    """The NUL and the huge model name, one request each (chat, tenant-a's key)."""
    for name, model in (("nul", "\u0000"), ("big", "m" * BIG_MODEL_CHARS)):
        call = Call("tenant-a", "chat", False, 5, None)
        sent = time.monotonic() - t0
        body = {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        try:
            async with session.post(f"{url}/v1/chat/completions", json=body,
                                    headers={"authorization": f"Bearer {_key(call.tenant)}"}) as resp:
                call.status, call.request_id = resp.status, resp.headers.get("x-request-id", "")
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            call.error = f"{type(exc).__name__}: {exc}"
        faults.bad_models.append({"name": name, "model_chars": len(model), "at_s": round(sent, 2),
                                  "status": call.status, "request_id": call.request_id,
                                  "error": call.error})


def _schedule(duration: float, kills: int, outage: float) -> tuple[list[float], float, float]:
    """Kill instants, the outage's start, and when the bad-model requests go."""
    at = [duration * i / (kills + 1) for i in range(1, kills + 1)]
    first = at[0] if at else duration / 2
    following = at[1] if len(at) > 1 else duration
    outage_start = (first + following) / 2 if at else max(0.0, (duration - outage) / 2)
    return at, outage_start, first / 2


async def _load(gateway: _Gateway, postgres: PostgresServer, duration: float, kills: int,
                outage: float, loops: int, seed: int, calls: list[Call], faults: Faults) -> None:
    stop = asyncio.Event()
    lock = asyncio.Lock()  # one gateway operation at a time
    kill_at, outage_at, bad_at = _schedule(duration, kills, outage)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = faults.t0 = time.monotonic()

        async def at(seconds: float) -> None:
            await asyncio.sleep(max(0.0, t0 + seconds - time.monotonic()))

        async def kill(seconds: float) -> None:
            await at(seconds)
            async with lock:
                killed = time.monotonic() - t0
                await asyncio.to_thread(gateway.kill)
                back = await asyncio.to_thread(gateway.start)
                faults.kills.append({"at_s": round(killed, 2), "answering_after_s": round(back, 2),
                                     "starts": gateway.starts})

        async def database_outage() -> None:
            if outage <= 0:
                return
            await at(outage_at)
            began = time.monotonic() - t0
            await asyncio.to_thread(postgres.stop)
            await at(outage_at + outage)
            await asyncio.to_thread(postgres.start)
            faults.outage = {"from_s": round(began, 2), "to_s": round(time.monotonic() - t0, 2)}

        async def bad() -> None:
            await at(bad_at)
            await _bad_models(session, gateway.url, faults, t0)

        clients = [asyncio.create_task(_loop(session, gateway.url, tenant,
                                             random.Random(f"{seed}-{tenant}-{i}"), stop, calls))
                   for tenant in RATES for i in range(loops)]
        await asyncio.gather(*(kill(s) for s in kill_at), database_outage(), bad(), at(duration))
        stop.set()
        for client in clients:  # every client leaves: what is in flight is cancelled
            client.cancel()
        await asyncio.gather(*clients, return_exceptions=True)


@dataclass(frozen=True)
class Row:
    request_id: str
    tenant: str
    model_chars: int
    completion_tokens: int
    finish_reason: str
    served: bool
    estimated: bool


def _rows(url: str) -> list[Row]:
    """Every row of the ledger, read with SQL alone (an older gateway's schema lacks
    ``estimated``; nothing here migrates it)."""
    with psycopg.connect(url, connect_timeout=10) as conn:
        columns = {r[0] for r in conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'requests'")}
        if not columns:
            return []
        estimated = "estimated" if "estimated" in columns else "0"
        found = conn.execute(
            "SELECT request_id, tenant, length(model), completion_tokens, finish_reason, "
            f"served, {estimated} FROM requests").fetchall()
    return [Row(r[0], r[1], int(r[2]), int(r[3]), r[4], bool(r[5]), bool(r[6])) for r in found]


def _journal_left(journal: Path, written: set[str]) -> dict[str, int]:
    """What the journal still holds that the database does not: row entries, and opens
    (requests sent to an engine) with no row anywhere; and the dead-letter rows."""
    rows: set[str] = set()
    opens: set[str] = set()
    for segment in journal.rglob("segment-*.jsonl"):
        for line in segment.read_bytes().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            for kind, ids in (("row", rows), ("open", opens)):
                body = entry.get(kind) if isinstance(entry, dict) else None
                if isinstance(body, list) and body:
                    ids.add(str(body[0]))
    dead = sum(len(p.read_bytes().splitlines()) for p in journal.rglob("dead-letter.jsonl"))
    return {"unwritten_rows": len(rows - written), "unsettled_opens": len(opens - rows - written),
            "dead_letter_rows": dead}


def _settle(url: str, journal: Path | None, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """Wait until the ledger's rows stop changing (3 readings a second apart) and the
    journal holds no unwritten row."""
    last: tuple[int, int] | None = None
    steady = 0
    deadline = time.monotonic() + timeout_s
    while steady < 3 and time.monotonic() < deadline:
        time.sleep(1.0)
        try:
            rows = _rows(url)
        except psycopg.Error:
            continue
        reading = (len(rows), sum(r.completion_tokens for r in rows))
        pending = journal is not None and \
            _journal_left(journal, {r.request_id for r in rows})["unwritten_rows"] > 0
        steady = steady + 1 if reading == last and not pending else 0
        last = reading


@dataclass
class EngineCount:
    """One gateway request at the engines: its engine user (the tenant), the tokens its
    engine requests were charged in the event logs, and the output tokens the engines'
    books of ended requests hold for them (None: not there)."""

    user: str
    charged: int = 0
    book: int | None = None
    last_s: float = 0.0  # its last charge (time.monotonic() seconds)


def _engine_counts(urls: Sequence[str], logs: Sequence[Path]) -> dict[str, EngineCount]:
    """Every gateway request id the engines ran (``tpg-...`` in the engine request id),
    from the event logs, with what each engine's ``POST /tokenpace/v1/aborted`` answers
    for its engine requests (the engines must still be running)."""
    import httpx

    counts: dict[str, EngineCount] = {}
    with httpx.Client(timeout=30, headers={"authorization": f"Bearer {ENGINE_KEY}"}) as http:
        for url, log in zip(urls, logs):
            engine_ids = []
            for (user, engine_id), stamps in read_charges(log).items():
                found = _REQUEST_ID.search(engine_id)
                if found is not None:
                    count = counts.setdefault(found.group(0), EngineCount(user))
                    count.charged += len(stamps)
                    count.last_s = max([count.last_s, *(t / 1e9 for t in stamps)])
                    engine_ids.append(engine_id)
            for page in range(0, len(engine_ids), 1024):
                answer = http.post(f"{url}/tokenpace/v1/aborted",
                                   json={"request_ids": engine_ids[page:page + 1024]}).json()
                for engine_id, output in answer.get("output_tokens", {}).items():
                    count = counts[_REQUEST_ID.search(engine_id).group(0)]  # type: ignore[union-attr]
                    count.book = (count.book or 0) + int(output)
    return counts


def _gateway_commit(src: Path | None) -> str | None:
    """The commit of the gateway's source tree (``git describe --always --dirty``: a
    ``-dirty`` suffix when it has uncommitted changes); None outside a checkout."""
    here = src or Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(["git", "-C", str(here), "describe", "--always", "--dirty"],
                              capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    return done.stdout.strip() or None


def run(model: Path, duration: float = 80.0, kills: int = 3, outage: float = 20.0,
        loops: int = 4, seed: int = 1, gateway_src: Path | None = None,
        workdir: Path | None = None) -> dict[str, Any]:
    """Run the scenario (module docstring) and return its figures; raises
    ``PostgresUnavailable`` before any engine starts when no Postgres can run here."""
    why = postgres_missing()
    if why is not None:
        raise PostgresUnavailable(why)
    home = Path(workdir or tempfile.mkdtemp(prefix="tokenpace-bench-metering-"))
    ports = [free_port(), free_port()]
    binds = cpu_binds(2, sorted(os.sched_getaffinity(0)), cpu_vllm=True, environ={})
    logs = [home / f"events-{port}.jsonl" for port in ports]
    engines = [Server(tokenpace_serve_argv(model, port, "--trusted-gateway",
                                           "--max-num-seqs", "32",
                                           "--output-rate-event-log", str(log),
                                           PROMPT_TOKENS_DETAILS),
                      port, home / f"engine-{port}.log",
                      env={CPU_BIND_ENV: bind or "", "VLLM_API_KEY": ENGINE_KEY})
               for port, bind, log in zip(ports, binds, logs)]
    env = {"PYTHONPATH": str(gateway_src)} if gateway_src is not None else {}
    journal = home / "journal"
    calls: list[Call] = []
    faults = Faults()
    gateway: _Gateway | None = None
    postgres: PostgresServer | None = None
    try:
        postgres = PostgresServer()  # initdb while the engines load
        ledger = postgres.start().database("usage")
        config = _gateway_config([e.base_url for e in engines], ledger, journal)
        dropped = _accepted(config, env)
        (home / "gateway.json").write_text(json.dumps(config, indent=2))
        gateway = _Gateway(home, home / "gateway.json", env)
        start_all(engines)
        gateway.start()
        asyncio.run(_load(gateway, postgres, duration, kills, outage, loops, seed, calls,
                          faults))
        _settle(ledger, journal if "ledger_journal" in config else None)
        gateway.stop()
        time.sleep(1.0)  # the engines write their event logs every 200 ms
        rows = _rows(ledger)
        counts = _engine_counts([e.base_url for e in engines], logs)
        journal_left = _journal_left(journal, {r.request_id for r in rows})
    finally:
        if gateway is not None:
            gateway.stop()
        for engine in engines:
            engine.stop()
        if postgres is not None:
            postgres.remove()
    result = _figures(calls, rows, counts, faults, journal_left)
    result["parameters"] = {
        "duration_s": duration, "kills": kills, "outage_s": outage, "loops_per_tenant": loops,
        "seed": seed, "rates": RATES, "max_tokens": list(MAX_TOKENS),
        "stream_share": STREAM_SHARE, "leave_share": LEAVE_SHARE,
        "big_model_chars": BIG_MODEL_CHARS, "engines": "2 x tiny, one pool (routing: pool)",
        "ledger": "postgresql (throwaway server)", "workdir": str(home)}
    result["gateway"] = {"source": str(gateway_src) if gateway_src else "this tree",
                         "commit": _gateway_commit(gateway_src),
                         "config_keys_left_out": dropped, "starts": gateway.starts}
    result.update(environment())
    _print(result)
    return result


def _against(rows: list[Row], engine: dict[str, int], client_ids: set[str]) -> dict[str, Any]:
    """The ledger against one engine-side count per gateway request id."""
    by_id = Counter(r.request_id for r in rows)
    without_client = client_ids - by_id.keys()
    without_engine = engine.keys() - by_id.keys()
    differs = [r for r in rows if r.served and r.completion_tokens != engine.get(r.request_id, 0)]
    return {
        "client_ids_without_row": len(without_client),
        "client_ids_without_row_tokens": sum(engine.get(i, 0) for i in without_client),
        "engine_requests_without_row": len(without_engine),
        "engine_requests_without_row_tokens": sum(engine[i] for i in without_engine),
        "rows_count_differs": len(differs),
        "rows_count_differs_tokens": sum(engine.get(r.request_id, 0) - r.completion_tokens
                                         for r in differs),
        "rows_count_differs_examples": [
            {"request_id": r.request_id, "ledger": r.completion_tokens,
             "engine": engine.get(r.request_id, 0), "finish_reason": r.finish_reason}
            for r in differs[:10]],
    }


def _lost_when(missing: Sequence[EngineCount], faults: Faults,
               window_s: float) -> dict[str, dict[str, int]]:
    """Requests the engines ran with no row, and their tokens, by when their last token
    was generated: within a second of a kill (in flight, or ended just before it), else
    in windows of ``window_s`` from the start of the load."""
    kills = [faults.t0 + k["at_s"] for k in faults.kills]
    lost: dict[str, dict[str, int]] = {}
    for count in sorted(missing, key=lambda c: c.last_s):
        at_kill = [i for i, k in enumerate(kills, 1) if abs(count.last_s - k) <= 1.0]
        if at_kill:
            name = f"at kill {at_kill[0]}"
        else:
            start = int((count.last_s - faults.t0) // window_s * window_s)
            name = f"ended {start}-{start + int(window_s)} s"
        entry = lost.setdefault(name, {"requests": 0, "tokens": 0})
        entry["requests"] += 1
        entry["tokens"] += count.book if count.book is not None else count.charged
    return lost


def _figures(calls: list[Call], rows: list[Row], counts: dict[str, EngineCount],
             faults: Faults, journal_left: dict[str, int]) -> dict[str, Any]:
    charged = {i: c.charged for i, c in counts.items()}
    books = {i: c.book for i, c in counts.items() if c.book is not None}
    tenants: dict[str, dict[str, int]] = {}
    for tenant in RATES:
        mine = [c for c in counts.values() if c.user == tenant]
        served = [r for r in rows if r.tenant == tenant and r.served]
        ledger = sum(r.completion_tokens for r in served)
        engine = sum(c.charged for c in mine)
        book = sum(c.book or 0 for c in mine)
        tenants[tenant] = {"rate": int(RATES[tenant]), "engine_tokens": engine,
                           "engine_book_tokens": book, "ledger_tokens": ledger,
                           "missing_tokens": engine - ledger,
                           "missing_tokens_to_book": book - ledger,
                           "engine_requests": len(mine), "served_rows": len(served)}
    client_ids = {c.request_id for c in calls if c.request_id}
    to_logs = _against(rows, charged, client_ids)
    to_books = _against(rows, books, client_ids)
    twice = [i for i, n in Counter(r.request_id for r in rows).items() if n > 1]
    row_ids = {r.request_id for r in rows}
    by_id = {r.request_id: r for r in rows}
    bad = [{**sent, "row": None if sent["request_id"] not in by_id else {
                "finish_reason": by_id[sent["request_id"]].finish_reason,
                "served": by_id[sent["request_id"]].served,
                "model_chars": by_id[sent["request_id"]].model_chars}}
           for sent in faults.bad_models]
    engine_total = sum(t["engine_tokens"] for t in tenants.values())
    ledger_total = sum(t["ledger_tokens"] for t in tenants.values())

    def exact(to: dict[str, Any], missing: str) -> bool:
        return all(t[missing] == 0 for t in tenants.values()) and not twice and not (
            to["client_ids_without_row"] or to["engine_requests_without_row"]
            or to["rows_count_differs"])

    return {
        "benchmark": "metering",
        "tenants": tenants,
        "engine_tokens": engine_total,
        "engine_book_tokens": sum(t["engine_book_tokens"] for t in tenants.values()),
        "ledger_tokens": ledger_total,
        "ledger_share": round(ledger_total / engine_total, 4) if engine_total else None,
        "engine_requests": len(counts),
        "to_event_logs": to_logs,
        "to_engine_books": to_books,
        "without_row_by_when": _lost_when(
            [c for i, c in counts.items() if i not in row_ids], faults, LOST_WINDOW_S),
        # A step in flight when its request was aborted: charged in the event log, its
        # token computed and dropped (vLLM ends aborted requests before it takes a step's
        # output), so the engine's book counts one token fewer.
        "aborted_with_a_step_in_flight": sum(1 for c in counts.values()
                                             if c.book is not None and c.charged == c.book + 1),
        "book_differs_otherwise": sum(1 for c in counts.values()
                                      if c.book is None or c.charged not in (c.book, c.book + 1)),
        "rows": len(rows),
        "ids_twice": len(twice),
        "estimated_rows": sum(r.estimated for r in rows),
        "rows_by_finish_reason": dict(Counter(
            "rejected" if r.finish_reason.startswith("rejected:") else r.finish_reason
            for r in rows)),
        **journal_left,
        "bad_models": bad,
        "exact_to_event_logs": exact(to_logs, "missing_tokens"),
        "exact_to_engine_books": exact(to_books, "missing_tokens_to_book"),
        "clients": {"requests": len(calls), "status": dict(Counter(str(c.status) for c in calls)),
                    "with_request_id": len(client_ids),
                    "left_mid_stream": sum(c.left for c in calls),
                    "no_answer": sum(c.status == 0 for c in calls),
                    "cut_after_answer": sum(c.status != 0 and c.error is not None
                                            for c in calls)},
        "faults": {"kills": faults.kills, "postgres_outage": faults.outage},
    }


def _print(result: dict[str, Any]) -> None:
    p, g, c = result["parameters"], result["gateway"], result["clients"]
    print(f"metering: gateway from {g['source']} ({g['commit']}), {p['duration_s']:g} s of load, "
          f"{len(result['faults']['kills'])} gateway SIGKILLs, Postgres down "
          f"{p['outage_s']:g} s; {c['requests']} requests ({c['no_answer']} not answered: "
          f"gateway down), {c['left_mid_stream']} left mid-stream")
    print(f"  {'tenant':<10}{'rate':>5}{'engine log':>12}{'engine book':>13}{'ledger':>9}"
          f"{'missing':>9}{'requests':>10}{'rows':>7}")
    for name, t in result["tenants"].items():
        print(f"  {name:<10}{t['rate']:>5}{t['engine_tokens']:>12,}{t['engine_book_tokens']:>13,}"
              f"{t['ledger_tokens']:>9,}{t['missing_tokens']:>9,}{t['engine_requests']:>10,}"
              f"{t['served_rows']:>7,}")
    share = result["ledger_share"]
    print(f"  {'all':<10}{'':>5}{result['engine_tokens']:>12,}{result['engine_book_tokens']:>13,}"
          f"{result['ledger_tokens']:>9,}{result['engine_tokens'] - result['ledger_tokens']:>9,}"
          f"   ledger / engine log {'-' if share is None else f'{share:.2%}'}")
    for name, to in (("event logs", result["to_event_logs"]),
                     ("engine books", result["to_engine_books"])):
        print(f"  against the {name}: without a row {to['client_ids_without_row']} ids clients "
              f"received ({to['client_ids_without_row_tokens']:,} tokens), "
              f"{to['engine_requests_without_row']} requests engines ran "
              f"({to['engine_requests_without_row_tokens']:,} tokens); rows whose count differs "
              f"{to['rows_count_differs']} ({to['rows_count_differs_tokens']:+,} tokens)")
    lost = result["without_row_by_when"]
    if lost:
        print("  requests with no row, by when they ended: " + ", ".join(
            f"{name} {v['requests']} ({v['tokens']:,} tokens)" for name, v in lost.items()))
    print(f"  aborted with a step in flight (log = book + 1): "
          f"{result['aborted_with_a_step_in_flight']}; ids twice {result['ids_twice']}, "
          f"estimated {result['estimated_rows']}, dead letters {result['dead_letter_rows']}, "
          f"journal rows left {result['unwritten_rows']}")
    for bad in result["bad_models"]:
        row = bad["row"]
        found = "no row" if row is None else \
            f"row {row['finish_reason']} (model {row['model_chars']:,} chars)"
        print(f"  model {bad['name']!r} ({bad['model_chars']:,} chars): HTTP {bad['status']}, {found}")
    print(f"  exact: against the event logs {'yes' if result['exact_to_event_logs'] else 'no'}, "
          f"against the engine books {'yes' if result['exact_to_engine_books'] else 'no'}")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Two engines on the tiny model in one pool behind the gateway, its ledger in a "
        "throwaway PostgreSQL (initdb and postgres must be installed) with a journal on disk; "
        "three paced tenants stream and call chat and completions, some clients leaving "
        "mid-stream. The gateway is SIGKILLed --kills times and started again at once, "
        "Postgres is stopped for --outage seconds, and a NUL and a 6 MiB model name are sent. "
        "At the end, per tenant, the ledger's completion tokens against what the engines "
        "counted (their event logs, and their books of ended requests), and per request: ids "
        "with no row, counts that differ, ids twice, estimated and dead-letter rows.")
    add_common_args(parser)
    parser.add_argument("--duration", type=positive_float, default=80.0,
                        help="seconds of load (default 80)")
    parser.add_argument("--kills", type=int, default=3, choices=range(0, 21), metavar="N",
                        help="gateway SIGKILLs, evenly spaced through the load (default 3)")
    parser.add_argument("--outage", type=float, default=20.0, metavar="S",
                        help="seconds Postgres is stopped, from halfway between the first kill "
                        "and the next on (default 20; 0: none)")
    parser.add_argument("--loops", type=positive_int, default=4,
                        help="client loops per tenant, each sending without pause (default 4)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the clients' choices")
    parser.add_argument("--gateway-src", type=Path, default=None, metavar="DIR",
                        help="run the gateway from this source tree (the src/ directory of "
                        "another checkout, e.g. an older commit's worktree; PYTHONPATH=DIR); "
                        "the engines stay this installation's")


def main(args: argparse.Namespace) -> int:
    if args.plot:
        raise SystemExit("tokenpace bench metering: error: --plot is not supported (use --json)")
    if args.quick:
        # the kill at 7 s, the outage from 10.5 to 13.5 s, the bad models at 3.5 s
        args.duration, args.kills, args.outage = 14.0, 1, 3.0
    if args.outage < 0:
        raise SystemExit("tokenpace bench metering: error: --outage must not be negative")
    check_gateway_src(args.gateway_src, "tokenpace bench metering")
    try:
        result = run(bench_model(args), args.duration, args.kills, args.outage, args.loops,
                     args.seed, gateway_src=args.gateway_src)
    except PostgresUnavailable as exc:
        raise SystemExit(f"tokenpace bench metering: error: needs a PostgreSQL server: {exc}")
    return write_outputs(args, result)
