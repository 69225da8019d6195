"""The architecture as import rules: `gateway -> engine.{protocol,errors,config} -> backends`,
and inside the gateway: API dialects apart from each other, above `gateway.training`.

* At run time: ``import gateway.main`` (and ``gateway.cli``) in a fresh interpreter loads no
  torch stack and no engine module beyond protocol / rules / errors / config.
* Statically: the import-linter contracts in ``.importlinter`` are all kept, every one of them is
  checked (none silently dropped), the gateway's forbidden list covers every engine module except
  the four it may use, and a module that breaks a contract makes ``lint-imports`` fail.
"""

from __future__ import annotations

import configparser
import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
GATEWAY_MAY_IMPORT = {"engine.protocol", "engine.rules", "engine.errors", "engine.config"}
HEAVY = ("torch", "transformers", "safetensors", "peft", "vllm")


def _contracts() -> dict[str, configparser.SectionProxy]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / ".importlinter")
    prefix = "importlinter:contract:"
    return {s.removeprefix(prefix): cfg[s] for s in cfg.sections() if s.startswith(prefix)}


def _lines(value: str) -> set[str]:
    return {ln.strip() for ln in value.splitlines() if ln.strip()}


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(root / ".importlinter")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_gateway_imports_no_torch_and_no_engine_internals():
    code = (
        "import sys, gateway.main, gateway.cli\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        f"allowed = {sorted(GATEWAY_MAY_IMPORT)!r}\n"
        "engine = sorted(m for m in sys.modules if m.startswith('engine.') and m not in allowed)\n"
        "assert not heavy and not engine, (heavy[:5], engine)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]


def test_forbidden_list_covers_every_engine_module_but_the_four():
    import engine

    children = {f"engine.{m.name}" for m in pkgutil.iter_modules(engine.__path__)}
    forbidden = _lines(_contracts()["gateway-engine-surface"]["forbidden_modules"])
    assert children >= GATEWAY_MAY_IMPORT
    assert forbidden == children - GATEWAY_MAY_IMPORT


def test_import_contracts_are_kept():
    out = _lint(REPO)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    text = " ".join(out.stdout.split())  # contract names wrap in the report
    names = [c["name"] for c in _contracts().values()]
    assert len(names) == 8
    for name in names:
        assert f"{name} KEPT" in text or f"{name} KEPT (" in text, name
    assert f"Contracts: {len(names)} kept, 0 broken." in text


@pytest.mark.parametrize(
    ("module", "source", "contract"),
    [
        ("gateway/_leak.py", "import engine.trainer\n", "gateway-engine-surface"),
        ("gateway/_leak.py", "def f():\n    import torch\n", "gateway-torch-free"),
        ("engine/backends/_leak.py", "import fastapi\n", "engine-no-web-or-db"),
        ("engine/backends/_leak.py", "from engine import trainer\n", "engine-layers"),
        ("engine/protocol_leak.py", "import gateway.errors\n", "gateway-above-engine"),
        ("admin_ui/_leak.py", "from gateway.db import make_engine\n", "admin-ui-rest-only"),
        (
            "gateway/twinkle_api/_leak.py",
            "from gateway.tinker_api import runs\n",
            "dialects-independent",
        ),
        ("gateway/openai_api/_leak.py", "import gateway.admin_api.admin\n", "dialects-independent"),
        (
            "gateway/training/_leak.py",
            "from gateway.openai_api import router\n",
            "training-below-dialects",
        ),
    ],
)
def test_a_violating_module_breaks_its_contract(tmp_path, module, source, contract):
    for pkg in ("gateway", "engine", "admin_ui"):
        shutil.copytree(
            REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    (tmp_path / module).write_text(source)
    out = _lint(tmp_path)
    assert out.returncode != 0, out.stdout[-3000:]
    text = " ".join(out.stdout.split())
    assert f"{_contracts()[contract]['name']} BROKEN" in text, out.stdout[-3000:]
