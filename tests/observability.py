"""The shipped observability files as data, for the tests: infra/observability/'s dashboards,
their PromQL expressions, the alert rules, and a copy of prometheus.yml pointed at a test server."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

OBS = Path(__file__).resolve().parents[1] / "infra" / "observability"
DASHBOARDS = OBS / "grafana" / "dashboards"
RULES = OBS / "twinkle-alerts.yml"
PROMETHEUS_YML = OBS / "prometheus.yml"
#: what the shipped prometheus.yml names, replaced in a test's copy
SHIPPED_GATEWAY = "127.0.0.1:8000"
SHIPPED_DATA_DIR = "/var/lib/twinkle"
#: `signal <op> number` at the end of an alert expression
_COMPARISON = re.compile(r"^(?P<signal>.*\S)\s*(?:==|!=|>=|<=|>|<)\s*-?[0-9.]+\s*$", re.S)


@dataclass(frozen=True)
class Query:
    where: str  # "<dashboard file> / <panel title> / <refId>" or "alert <name>"
    expr: str


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panel_queries() -> list[Query]:
    return [
        Query(f"{name} / {p['title']} / {t['refId']}", t["expr"])
        for name, d in dashboards().items()
        for p in d["panels"]
        for t in p["targets"]
    ]


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def alert_queries() -> list[Query]:
    return [Query(f"alert {r['alert']}", " ".join(r["expr"].split())) for r in alert_rules()]


def signal(expr: str) -> str:
    """An alert expression without its final threshold comparison (what the alert watches)."""
    m = _COMPARISON.match(expr)
    assert m, f"alert expression is not `signal <op> threshold`: {expr}"
    return m.group("signal")


def instantiate(expr: str, rate_interval: str) -> str:
    """A dashboard expression as Grafana would send it with every model selected."""
    return expr.replace("$__rate_interval", rate_interval).replace("$model", ".*")


def prometheus_config(
    out: Path, gateway: str, data_dir: Path, interval_s: float, gateway_bearer: str | None = None
) -> Path:
    """A copy of the shipped prometheus.yml (and the rules beside it) in ``out``, scraping
    ``gateway`` and the engine targets under ``data_dir`` every ``interval_s`` seconds."""
    text = PROMETHEUS_YML.read_text()
    assert SHIPPED_GATEWAY in text and SHIPPED_DATA_DIR in text
    text = text.replace(SHIPPED_GATEWAY, gateway).replace(SHIPPED_DATA_DIR, str(data_dir))
    cfg = yaml.safe_load(text)
    iv = f"{int(interval_s * 1000)}ms"
    cfg["global"].update(scrape_interval=iv, evaluation_interval=iv)
    for job in cfg["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            sd["refresh_interval"] = "1s"
        if gateway_bearer and job["job_name"] == "twinkle-gateway":
            job["authorization"] = {"type": "Bearer", "credentials": gateway_bearer}
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(RULES, out / RULES.name)
    path = out / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path
