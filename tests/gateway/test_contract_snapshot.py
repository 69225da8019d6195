"""Contract test of the Tinker surface: the routes, their request schemas and their JSON response
schemas (the 200 answer) are snapshotted in tests/gateway/contract/tinker_api.json, and every
`/api/v1/...` route the installed tinker SDK names in its source is either served or listed in
UNSUPPORTED with the reason.

On an intended change, regenerate the snapshot and review its diff:

    UPDATE_CONTRACT=1 .venv/bin/python -m pytest -q tests/gateway/test_contract_snapshot.py
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import tinker

from gateway.config import ServerConfig
from gateway.main import create_app
from gateway.settings import Settings

SNAPSHOT = Path(__file__).parent / "contract" / "tinker_api.json"
_SDK_ROUTE = re.compile(r"""f?["'](/api/v1/[A-Za-z0-9_/{}.\-]+)["']""")
_PARAM = re.compile(r"\{[^}]*\}")

#: (METHOD-less) SDK routes we do not serve, and why (the README's table says the same)
UNSUPPORTED = {
    "/api/v1/join_sampling_session": "opt-in flag sample_join_sampling_session is off",
    "/api/v1/retrieve_futures": "opt-in flag sample_use_retrieve_futures is off",
    "/api/v1/cancel_future": "opt-in flag sample_cancel_enabled is off",
    "/api/v1/sessions/search": "experimental session search is not implemented",
    "/api/v1/sessions/test-session": "an example id in an SDK docstring, not a route",
}


#: routes only older SDKs (the 0.16.x JSON line) call; served by gateway/tinker_api/compat.py
OLD_SDK_ROUTES = {"/api/v1/forward", "/api/v1/unload_model"}


def _norm(path: str) -> str:
    return _PARAM.sub("{}", path).rstrip("/")


def sdk_routes() -> set[str]:
    root = Path(tinker.__file__).parent
    found: set[str] = set()
    for f in root.rglob("*.py"):
        for m in _SDK_ROUTE.finditer(f.read_text(errors="ignore")):
            found.add(_norm(m.group(1)))
    return found


def _resolve(schema: dict, components: dict) -> dict:
    if "$ref" in schema:
        return _resolve(components[schema["$ref"].rsplit("/", 1)[1]], components)
    out = {}
    for k, v in schema.items():
        if k in ("title", "description"):
            continue
        if isinstance(v, dict):
            out[k] = _resolve(v, components)
        elif isinstance(v, list):
            out[k] = [_resolve(x, components) if isinstance(x, dict) else x for x in v]
        else:
            out[k] = v
    return out


def current_contract() -> dict:
    app = create_app(
        Settings(data_dir=Path("/nonexistent"), database_url="sqlite://"), ServerConfig(), None
    )
    spec = app.openapi()
    components = spec.get("components", {}).get("schemas", {})
    sdk = sdk_routes()
    contract: dict = {}
    for path, methods in sorted(spec["paths"].items()):
        if not path.startswith("/api/v1/"):
            continue
        ours = path.startswith("/api/v1/external_weights/") or path in OLD_SDK_ROUTES
        if _norm(path) not in sdk and not ours:
            continue  # other surfaces (native, admin, OpenAI) have their own tests
        for method, op in sorted(methods.items()):
            params = sorted(
                (p["name"], p["in"], bool(p.get("required"))) for p in op.get("parameters", [])
            )
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            ok = op.get("responses", {}).get("200", {}).get("content", {})
            answer = ok.get("application/json", {}).get("schema")
            contract[f"{method.upper()} {path}"] = {
                "parameters": [list(p) for p in params],
                "body": _resolve(body.get("schema", {}), components) if body else None,
                # None: not JSON, or JSON of no fixed shape (retrieve_future, downloads)
                "response": _resolve(answer, components) if answer else None,
            }
    return contract


def test_contract_matches_snapshot() -> None:
    current = current_contract()
    if os.environ.get("UPDATE_CONTRACT") == "1":
        SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
        SNAPSHOT.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    saved = json.loads(SNAPSHOT.read_text())
    added, removed = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    changed = sorted(k for k in set(current) & set(saved) if current[k] != saved[k])
    assert not (added or removed or changed), (
        f"Tinker API contract drifted: added {added}, removed {removed}, changed {changed}. "
        "If intended, run `UPDATE_CONTRACT=1 .venv/bin/python -m pytest -q "
        "tests/gateway/test_contract_snapshot.py` and commit tests/gateway/contract/tinker_api.json"
    )


def test_every_sdk_route_is_served_or_explained() -> None:
    served = {_norm(k.split(" ", 1)[1]) for k in current_contract()}
    missing = sorted(r for r in sdk_routes() - served if r not in UNSUPPORTED)
    assert not missing, f"SDK routes neither served nor listed in UNSUPPORTED: {missing}"
    assert len(sdk_routes()) >= 40  # the scan found the SDK's routes (not vacuous)


def test_snapshot_check_is_not_vacuous() -> None:
    contract = current_contract()
    assert "PUT /api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/ttl" in contract
    typed = contract["POST /api/v1/create_model"]["response"]
    assert typed["required"] == ["request_id", "model_id"], typed
    tampered = dict(contract)
    tampered.pop(next(iter(tampered)))
    assert tampered != json.loads(SNAPSHOT.read_text())
