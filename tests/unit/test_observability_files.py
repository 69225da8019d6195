"""infra/observability/ is valid: `promtool check config` / `check rules` pass on the shipped files;
every Grafana dashboard matches the JSON Schema beside it and survives a round-trip through the
Grafana Foundation SDK's dashboard model without losing a key (an unknown or misspelt key would
be dropped), with unique panel ids, a 24-column grid without overlaps and only variables it
defines; every alert is `signal <op> threshold` with a summary; the README explains every panel
and alert. (tests/e2e/test_observability.py runs every expression against real data.)"""

from __future__ import annotations

import json
import re
import subprocess

import jsonschema
import pytest
import yaml

from tests.observability import (
    OBS,
    PROMETHEUS_YML,
    RULES,
    alert_rules,
    dashboards,
    signal,
)

README = (OBS / "README.md").read_text()


def test_promtool_accepts_the_config_and_the_rules(promtool) -> None:
    out = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 rule files found" in out.stdout
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(alert_rules())} rules found" in out.stdout


def test_promtool_rejects_a_broken_rule(promtool, tmp_path) -> None:
    """The check above can fail: a rule with a PromQL syntax error does not pass."""
    rules = yaml.safe_load(RULES.read_text())
    rules["groups"][0]["rules"][0]["expr"] = "sum by (model (twinkle_engine_queue_depth)"
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump(rules))
    out = subprocess.run([promtool, "check", "rules", str(bad)], capture_output=True, text=True)
    assert out.returncode != 0


def _roundtrip_losses(d: dict) -> list[str]:
    """Keys of ``d`` that the Foundation SDK's Dashboard model does not keep."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()  # panel options and Prometheus queries decode to typed models
    back = json.loads(json.dumps(Dashboard.from_json(d), cls=JSONEncoder))
    lost: list[str] = []

    def walk(a, b, path: str) -> None:
        if isinstance(a, dict):
            for k, v in a.items():
                if not isinstance(b, dict) or k not in b:
                    lost.append(f"{path}/{k}")
                else:
                    walk(v, b[k], f"{path}/{k}")
        elif isinstance(a, list):
            if not isinstance(b, list) or len(a) != len(b):
                lost.append(path)
            else:
                for i, (x, y) in enumerate(zip(a, b, strict=True)):
                    walk(x, y, f"{path}[{i}]")
        elif a != b:
            lost.append(f"{path} ({a!r} became {b!r})")

    walk(d, back, "")
    return lost


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_dashboard_is_valid_grafana_json(name: str) -> None:
    d = dashboards()[name]
    schema = json.loads((OBS / "grafana" / "dashboard.schema.json").read_text())
    jsonschema.validate(d, schema)
    assert _roundtrip_losses(d) == []
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
    defined = {v["name"] for v in d["templating"]["list"]} | {"__rate_interval"}
    used = set(re.findall(r"\$\{?(\w+)", json.dumps(d["panels"])))
    assert used <= defined, used - defined


def test_the_validation_catches_unknown_keys_and_bad_types() -> None:
    d = dashboards()["engine.json"]
    typo = json.loads(json.dumps(d))
    typo["panels"][0]["gridpos"] = typo["panels"][0].pop("gridPos")
    assert "/panels[0]/gridpos" in _roundtrip_losses(typo)
    bad = json.loads(json.dumps(d))
    bad["panels"][0]["gridPos"]["w"] = "12"
    schema = json.loads((OBS / "grafana" / "dashboard.schema.json").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_dashboard_uids_are_unique_and_provisioning_points_at_them() -> None:
    uids = [d["uid"] for d in dashboards().values()]
    assert len(uids) == len(set(uids))
    prov = OBS / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "twinkle-prometheus.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    dash = yaml.safe_load((prov / "dashboards" / "twinkle.yml").read_text())
    assert dash["providers"][0]["type"] == "file"


def test_alerts_are_signal_over_threshold_and_documented() -> None:
    for r in alert_rules():
        assert signal(" ".join(r["expr"].split()))
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        assert r["labels"]["severity"] in ("info", "warning", "critical")
        assert f"`{r['alert']}`" in README, f"README does not explain {r['alert']}"


def test_readme_explains_every_panel() -> None:
    titles = {p["title"] for d in dashboards().values() for p in d["panels"]}
    missing = sorted(t for t in titles if f"**{t}**" not in README)
    assert not missing, f"README does not explain panels {missing}"
