"""``tokenpace usage`` against real SQLite ledgers: table, JSON, grouping, --since forms,
--config with a relative ledger path, and its errors."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tokenpace.gateway.ledger import UsageRecord, open_ledger, parse_since, resolve_ledger_url
from tokenpace.gateway.ledger._cli import main

NOV28 = datetime(2024, 11, 28, 12, 0, tzinfo=timezone.utc).timestamp()
NOV29 = datetime(2024, 11, 29, 12, 0, tzinfo=timezone.utc).timestamp()


def _rec(rid: str, tenant: str, model: str, lane: str, prompt: int, completion: int,
         ended_at: float, finish: str = "stop", cached: int = 0) -> UsageRecord:
    served = not finish.startswith("rejected:")  # a refusal keeps its counted prompt size
    return UsageRecord(rid, tenant, model, lane, prompt, completion,
                       0.5 * prompt + 1.5 * completion if served else 0.0, 2.0, 40.0, 900.0,
                       finish, ended_at - 1.0, ended_at, served=served,
                       cached_prompt_tokens=cached)


def _write(path: Path, recs: list[UsageRecord]) -> str:
    url = f"sqlite:///{path}"
    ledger = open_ledger(url)
    for rec in recs:
        ledger.record(rec)
    ledger.close()
    return url


@pytest.fixture
def ledger_url(tmp_path: Path) -> str:
    """Two days of traffic in 2024 plus, for relative --since, two rows near now."""
    now = time.time()
    return _write(tmp_path / "usage.db", [
        _rec("a", "acme", "tiny", "interactive", 100, 10, NOV28, cached=60),
        _rec("b", "beta", "tiny", "batch", 40, 4, NOV28 + 60),
        # Its counts are the gateway's estimate (the engine could not tell).
        replace(_rec("c", "acme", "big", "batch", 10, 1, NOV29), estimated=True),
        _rec("d", "beta", "big", "interactive", 12, 0, NOV29 + 60, "rejected:concurrency"),
        _rec("e", "acme", "tiny", "interactive", 7, 3, now - 3 * 3600),
        _rec("f", "", "tiny", "interactive", 0, 0, now - 60, "rejected:unknown_key"),
    ])


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[dict[str, object]]:
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_table_has_aligned_columns_and_a_total(
    ledger_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--ledger", ledger_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "tenant", "requests", "rejected", "prompt_tokens", "cached_prompt_tokens",
        "completion_tokens", "cost", "unserved_prompt_tokens", "estimated_rows",
    ]
    # Served and unserved prompt tokens in separate columns: beta's refused request
    # counted 12 prompt tokens that the engine never saw.
    assert [line.split() for line in lines[1:4]] == [
        ["(none)", "1", "1", "0", "0", "0", "0", "0", "0"],
        ["acme", "3", "0", "117", "60", "14", "79.5", "0", "1"],
        ["beta", "2", "1", "40", "0", "4", "26", "12", "0"],
    ]
    assert set(lines[4].replace(" ", "")) == {"-"}
    assert lines[5].split() == ["total", "6", "2", "157", "60", "18", "105.5", "12", "1"]
    # Right-aligned numbers: every column ends at the same place as its header.
    ends = [lines[0].index(h) + len(h) for h in ("requests", "estimated_rows")]
    for line in lines[1:4] + lines[5:]:
        assert len(line) == ends[1]
        assert line[ends[0] - 1] != " "


def test_json_by_model_and_lane(ledger_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _json(capsys, ["--ledger", ledger_url, "--by", "model"]) == [
        {"model": "big", "requests": 2, "rejected": 1, "prompt_tokens": 10,
         "cached_prompt_tokens": 0, "completion_tokens": 1, "cost": 6.5,
         "unserved_prompt_tokens": 12, "estimated_rows": 1},
        {"model": "tiny", "requests": 4, "rejected": 1, "prompt_tokens": 147,
         "cached_prompt_tokens": 60, "completion_tokens": 17, "cost": 99.0,
         "unserved_prompt_tokens": 0, "estimated_rows": 0},
    ]
    by_lane = _json(capsys, ["--ledger", ledger_url, "--by", "lane"])
    assert [(x["lane"], x["requests"]) for x in by_lane] == [("batch", 2), ("interactive", 4)]


def test_by_application_names_tenant_and_application(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two columns name a row: the same application id in two tenants stays two rows, a
    tenant's own keys get a row of their own, and a "/" in an id cannot blur the two."""
    def rec(rid: str, tenant: str, application: str, prompt: int, completion: int,
            finish: str = "stop") -> UsageRecord:
        return replace(_rec(rid, tenant, "tiny", "interactive", prompt, completion, NOV28,
                            finish), application=application)

    url = _write(tmp_path / "usage.db", [
        rec("a", "acme", "chat", 100, 10),
        rec("b", "acme", "chat", 20, 2),
        rec("c", "acme", "batch", 4, 4),
        rec("d", "acme", "", 6, 2),  # a tenant-level key
        rec("e", "beta", "chat", 40, 0, "rejected:concurrency"),
        rec("f", "beta/x", "y", 2, 2),
        rec("g", "", "", 0, 0, "rejected:unknown_key"),
    ])
    assert main(["--ledger", url, "--by", "application"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "tenant", "application", "requests", "rejected", "prompt_tokens",
        "cached_prompt_tokens", "completion_tokens", "cost", "unserved_prompt_tokens",
        "estimated_rows",
    ]
    assert [line.split() for line in lines[1:7]] == [
        ["(none)", "(none)", "1", "1", "0", "0", "0", "0", "0", "0"],
        ["acme", "(none)", "1", "0", "6", "0", "2", "6", "0", "0"],
        ["acme", "batch", "1", "0", "4", "0", "4", "8", "0", "0"],
        ["acme", "chat", "2", "0", "120", "0", "12", "78", "0", "0"],
        ["beta", "chat", "1", "1", "0", "0", "0", "0", "40", "0"],
        ["beta/x", "y", "1", "0", "2", "0", "2", "4", "0", "0"],
    ]
    assert lines[8].split() == ["total", "7", "2", "132", "0", "20", "96", "40", "0"]
    # Both name columns left-aligned: the application column starts at its header.
    start = lines[0].index("application")
    assert all(line[start - 2:start] == "  " and line[start] != " " for line in lines[1:7])

    totals = _json(capsys, ["--ledger", url, "--by", "application"])
    assert [(x["tenant"], x["application"], x["requests"]) for x in totals] == [
        ("", "", 1), ("acme", "", 1), ("acme", "batch", 1), ("acme", "chat", 2),
        ("beta", "chat", 1), ("beta/x", "y", 1),
    ]
    assert list(totals[0]) == [
        "tenant", "application", "requests", "rejected", "prompt_tokens",
        "cached_prompt_tokens", "completion_tokens", "cost", "unserved_prompt_tokens",
        "estimated_rows",
    ]
    # By tenant, the applications merge into their tenant again.
    by_tenant = _json(capsys, ["--ledger", url])
    assert [(x["tenant"], x["requests"]) for x in by_tenant] == [
        ("", 1), ("acme", 4), ("beta", 1), ("beta/x", 1)]


def test_since_relative(ledger_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert [x["tenant"] for x in _json(capsys, ["--ledger", ledger_url, "--since", "15m"])] == [""]
    assert [x["tenant"] for x in _json(capsys, ["--ledger", ledger_url, "--since", "4h"])] == [
        "", "acme"
    ]
    everything = _json(capsys, ["--ledger", ledger_url, "--since", "36500d"])
    assert sum(int(x["requests"]) for x in everything) == 6  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("since", "requests"),
    [
        ("2024-11-29", 4),  # midnight UTC: rows c, d, and the two near now
        ("2024-11-29T12:00:00", 4),  # inclusive
        ("2024-11-29T12:00:01Z", 3),
        ("2024-11-29T13:00:30+01:00", 3),  # 12:00:30 UTC
        ("2024-11-29T13:01:30+01:00", 2),
        ("2024-11-28", 6),
    ],
)
def test_since_absolute(
    ledger_url: str, capsys: pytest.CaptureFixture[str], since: str, requests: int
) -> None:
    totals = _json(capsys, ["--ledger", ledger_url, "--since", since])
    assert sum(int(x["requests"]) for x in totals) == requests  # type: ignore[call-overload]


def test_parse_since_forms() -> None:
    assert parse_since("90s", now=1000.0) == 910.0
    assert parse_since("15m", now=1000.0) == 100.0
    assert parse_since("2h", now=10_000.0) == 2800.0
    assert parse_since("7d", now=10**6) == 10**6 - 7 * 86400
    assert parse_since("1.5h", now=10_000.0) == 4600.0
    assert parse_since("2024-11-29T12:00:00Z") == NOV29
    for bad in ("yesterday", "5w", "-5m", "", "2026-13-01"):
        with pytest.raises(ValueError):
            parse_since(bad)


@pytest.mark.parametrize("since", ["yesterday", "10 minutes", "2026-11-31"])
def test_bad_since_is_a_usage_error(
    ledger_url: str, capsys: pytest.CaptureFixture[str], since: str
) -> None:
    assert main(["--ledger", ledger_url, "--since", since]) == 2
    err = capsys.readouterr().err
    assert "argument --since" in err and "7d" in err


def test_bad_arguments_exit_2(ledger_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2  # --config or --ledger is required
    assert main(["--ledger", ledger_url, "--by", "day"]) == 2
    assert main(["--ledger", "mysql://h/db"]) == 2
    assert "argument --ledger" in capsys.readouterr().err
    assert main(["--ledger", ledger_url, "--config", "gateway.yaml"]) == 2


def test_missing_sqlite_file_is_an_error_and_is_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "nope.db"
    assert main(["--ledger", f"sqlite:///{path}"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert not path.exists()


def test_config_with_relative_ledger_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    conf_dir = tmp_path / "conf"
    (conf_dir / "data").mkdir(parents=True)
    _write(conf_dir / "data" / "usage.db", [_rec("a", "acme", "tiny", "interactive", 4, 2, NOV28)])
    config = conf_dir / "gateway.yaml"
    # The rest of the config is not read: unknown keys or engines do not matter here.
    config.write_text(
        "engines: [{url: 'http://nowhere:1'}]\nledger: sqlite:///data/usage.db\nwhatever: 1\n"
    )
    monkeypatch.chdir(tmp_path)  # not the config's directory
    assert _json(capsys, ["--config", "conf/gateway.yaml"]) == [
        {"tenant": "acme", "requests": 1, "rejected": 0, "prompt_tokens": 4,
         "cached_prompt_tokens": 0, "completion_tokens": 2, "cost": 5.0,
         "unserved_prompt_tokens": 0, "estimated_rows": 0},
    ]


def test_config_without_ledger_key_uses_the_default_next_to_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("tenants: []\n")
    assert main(["--config", str(config)]) == 1
    assert str(tmp_path / "tokenpace-usage.db") in capsys.readouterr().err
    _write(tmp_path / "tokenpace-usage.db", [_rec("a", "acme", "m", "l", 1, 1, NOV28)])
    assert main(["--config", str(config)]) == 0
    assert "acme" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "cannot read"),
        ("ledger: [1, 2]\n", "ledger must be a URL"),
        ("- a\n- b\n", "mapping"),
        ("ledger: 'x\n", "not valid YAML"),
        ("ledger: mysql://h/db\n", "unsupported ledger URL"),
    ],
)
def test_config_errors_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None, message: str
) -> None:
    config = tmp_path / "gateway.yaml"
    if text is not None:
        config.write_text(text)
    assert main(["--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert message in err and str(config) in err


def test_empty_ledger_prints_zero_totals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _write(tmp_path / "empty.db", [])
    assert main(["--ledger", url, "--by", "lane"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "lane"
    assert lines[-1].split() == ["total", "0", "0", "0", "0", "0", "0", "0", "0"]
    assert _json(capsys, ["--ledger", url]) == []


def test_resolve_ledger_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "etc"
    assert resolve_ledger_url("sqlite:///u.db", base) == f"sqlite:///{base / 'u.db'}"
    assert resolve_ledger_url("sqlite:///a/../u.db", base) == f"sqlite:///{base / 'a/../u.db'}"
    assert resolve_ledger_url("sqlite:////var/u.db", base) == "sqlite:////var/u.db"
    pg = "postgresql://gw@db:5432/usage"
    assert resolve_ledger_url(pg, base) == pg
    monkeypatch.chdir(tmp_path)
    assert resolve_ledger_url("sqlite:///u.db", Path("etc")) == f"sqlite:///{base / 'u.db'}"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_ledger_url("sqlite:///~/u.db", base) == f"sqlite:///{tmp_path / 'u.db'}"
