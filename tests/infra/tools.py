"""The infra test tools in .tools/ (scripts/install_infra_tools.sh): Terraform 1.0.3 with the null
provider as a local plugin dir, python-hcl2 in the Terraform venv, checkov in its own venv.

Missing tools skip the test with the reason, except under CI (``CI=1``), where they fail it:
install.sh installs them, so a missing one there is a broken install.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / ".tools"
TERRAFORM = TOOLS / "bin" / "terraform"
PLUGIN_DIR = TOOLS / "terraform-plugins"
HCL_PYTHON = TOOLS / "terraform-venv" / "bin" / "python"
CHECKOV = TOOLS / "checkov-venv" / "bin" / "checkov"
TF_ROOT = REPO / "infra" / "terraform"
MODULES = TF_ROOT / "modules"


def require(path: Path) -> Path:
    if path.exists():
        return path
    msg = (
        f"{path.relative_to(REPO)} missing: run scripts/install.sh (scripts/install_infra_tools.sh)"
    )
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


def tf_env() -> dict[str, str]:
    # No checkpoint calls home, no prompts, no plugin cache shared with other runs.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    return env | {"TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1", "TF_INPUT": "0"}


def terraform(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run terraform (``-no-color``); fail the test with its output on a non-zero exit."""
    cmd = [str(require(TERRAFORM)), *args]
    out = subprocess.run(
        cmd, cwd=cwd, env=tf_env(), capture_output=True, text=True, timeout=timeout
    )
    if out.returncode != 0:
        pytest.fail(
            f"terraform {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
        )
    return out


def init(cwd: Path) -> None:
    """``init`` with no backend and providers only from the local plugin dir (no registry)."""
    terraform("init", "-backend=false", "-no-color", f"-plugin-dir={require(PLUGIN_DIR)}", cwd=cwd)


def copy_tree(dst: Path) -> Path:
    """infra/terraform copied to ``dst`` (init writes .terraform/ and a lock file beside the root
    module; the repo stays clean). Returns the copy's root."""
    root = dst / "terraform"
    shutil.copytree(TF_ROOT, root, ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*"))
    return root


def outputs(cwd: Path) -> dict:
    out = terraform("output", "-json", "-no-color", cwd=cwd)
    return {k: v["value"] for k, v in json.loads(out.stdout).items()}


def hcl(module: Path) -> dict[str, dict]:
    """Every .tf file of ``module`` parsed by python-hcl2 (in the tools venv), quotes removed."""
    out = subprocess.run(
        [str(require(HCL_PYTHON)), str(Path(__file__).with_name("hcl_dump.py")), str(module)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)
