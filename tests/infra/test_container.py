"""infra/container/Dockerfile checked against the repo, without building it (no Docker daemon
and no registry here): pinned bases and tools, every copied path exists and covers what the
package needs at run time, the install steps are scripts/install.sh's, and the command, port,
user and health path agree with the CLI, the gateway's routes and the Kubernetes manifests."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.infra import tools

DOCKERFILE = tools.REPO / "infra" / "container" / "Dockerfile"
INSTALL_SH = (tools.REPO / "scripts" / "install.sh").read_text()


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    assert not pending, "dangling line continuation"
    return out


INSTR = _instructions()


def _all(word: str) -> list[str]:
    return [args for w, args in INSTR if w == word]


def _args() -> dict[str, str]:
    return dict(a.split("=", 1) for a in _all("ARG") if "=" in a)


def test_base_image_and_tools_pinned() -> None:
    args = _args()
    stages: set[str] = set()
    for from_ in _all("FROM"):
        image, _, stage = from_.partition(" AS ")
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        if image.split(":")[0] not in stages:  # an earlier stage, or a pinned image
            assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+-[\w-]+", image), image
        stages.add(stage.strip())
    # the Python the install script uses (python3.11)
    assert re.search(r"PY=\$\{PYTHON:-python3\.11\}", INSTALL_SH)
    assert args["PYTHON_IMAGE"].startswith("python:3.11.")
    assert re.search(r"pip==\d+\.\d+\.\d+", DOCKERFILE.read_text())


def test_variants_cpu_and_gpu() -> None:
    args = _args()
    assert args["VARIANT"] == "cpu"
    stages = {f.partition(" AS ")[2].strip() for f in _all("FROM")}
    assert {"torch-cpu", "torch-gpu"} <= stages
    assert "FROM torch-${VARIANT} AS app" in {f"FROM {f}" for f in _all("FROM")}
    runs: dict[str, list[str]] = {}
    stage = ""
    for word, rest in INSTR:
        if word == "FROM":
            stage = rest.partition(" AS ")[2].strip()
        elif word == "RUN":
            runs.setdefault(stage, []).append(rest)
    # the cpu stage takes torch from PyTorch's CPU index; the gpu stage the PyPI (CUDA) build
    ((cpu,), (gpu,)) = runs["torch-cpu"], runs["torch-gpu"]
    assert "--index-url https://download.pytorch.org/whl/cpu" in cpu
    assert "--index-url" not in gpu and "torch==" in gpu


def test_copied_paths_exist_and_cover_the_package() -> None:
    copied = set()
    for args in _all("COPY"):
        *sources, _dest = shlex.split(args)
        for src in sources:
            assert (tools.REPO / src).exists(), f"COPY {src}: not in the repo"
            copied.add(src.rstrip("/"))
    pyproject = tomllib.loads((tools.REPO / "pyproject.toml").read_text())
    packages = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    for pattern in packages:
        assert pattern.rstrip("*") in copied, f"package {pattern} not copied"
    # read at run time relative to the checkout: migrations (gateway/db) and the client package
    from gateway.db import MIGRATIONS_DIR, REPO_ROOT

    assert MIGRATIONS_DIR.relative_to(REPO_ROOT).as_posix() in copied
    assert {"client", "constraints.txt", "pyproject.toml"} <= copied
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", ".tools", ".twinkle", ".git"} <= set(ignore)


def test_install_steps_match_install_sh() -> None:
    runs = " ".join(_all("RUN"))
    # torch first, the version constraints.txt pins, picked out exactly as install.sh does
    torch_pick = "$(grep -E '^torch==' constraints.txt)"
    assert "TORCH=" + torch_pick in INSTALL_SH and runs.count(torch_pick) == 2
    main = re.search(r"pip install (.*?) -e ./client", runs)
    assert main, runs
    assert "-c constraints.txt" in main.group(1)
    sh = re.search(
        r'"\$\{PIP\[@\]\}" install "\$\{FIND\[@\]\}" -c constraints.txt -e (\S+) -e ./client',
        INSTALL_SH,
    )
    assert sh, "install.sh changed: update infra/container/Dockerfile and this test"
    extras = set(pyproject_extras())
    image_m = re.search(r"-e '\.\[([\w,]+)\]'", main.group(1))
    assert image_m, main.group(1)
    image_extras = set(image_m.group(1).split(","))
    sh_extras = set(sh.group(1).strip("'.[]").split(","))
    # the image installs install.sh's extras minus the dev tools
    assert image_extras <= extras and image_extras == sh_extras - {"dev"}
    # the same torch check as install.sh, and it names the version constraints.txt pins
    check = re.search(
        r"-c '(import torch; assert torch.__version__.startswith\(\"([\d.]+)\"\)[^']*)'", INSTALL_SH
    )
    assert check and check.group(1) in runs
    pinned = re.search(r"^torch==([\d.]+)$", (tools.REPO / "constraints.txt").read_text(), re.M)
    assert pinned and pinned.group(1).startswith(check.group(2))


def pyproject_extras() -> list[str]:
    pyproject = tomllib.loads((tools.REPO / "pyproject.toml").read_text())
    return list(pyproject["project"]["optional-dependencies"])


def test_command_port_user_health_agree_with_the_code() -> None:
    import json

    from gateway.tinker_api.sessions import router

    (cmd,) = _all("CMD")
    argv = json.loads(cmd)
    pyproject = tomllib.loads((tools.REPO / "pyproject.toml").read_text())
    assert argv[0] in pyproject["project"]["scripts"] and argv[1] == "serve"
    # every flag is one `twinkle serve` accepts
    twinkle = Path(sys.executable).with_name("twinkle")
    help_text = subprocess.run(
        [str(twinkle), "serve", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    for flag in (a for a in argv if a.startswith("--")):
        assert flag in help_text, flag
    port = argv[argv.index("--port") + 1]
    (expose,) = _all("EXPOSE")
    assert expose == port
    (health,) = _all("HEALTHCHECK")
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/[\w/]+)", health)
    assert url and url.group(1) == port
    assert url.group(2) in {getattr(r, "path", None) for r in router.routes}
    # the manifests run as the image's user, on its port, with its PATH's commands
    manifests = (tools.MODULES / "twinkle-manifests" / "main.tf").read_text()
    variables = (tools.MODULES / "twinkle-manifests" / "variables.tf").read_text()
    (user,) = _all("USER")
    uid = user.split(":")[0]
    assert re.search(rf"runAsUser\s*=\s*{uid}\b", manifests)
    assert re.search(rf'variable "port" \{{[^}}]*default\s*=\s*{port}\b', variables, re.S)
    env = " ".join(_all("ENV"))
    assert "PATH=/opt/twinkle/.venv/bin:$PATH" in env and "TWINKLE_DATA_DIR=/data" in env
    assert re.search(r'variable "data_dir" \{[^}]*default\s*=\s*"/data"', variables, re.S)


def test_ray_cli_used_by_the_manifests_exists() -> None:
    """KubeRay runs `ray start` in the Ray containers; the probes run `ray health-check`."""
    ray = Path(sys.executable).with_name("ray")
    if not ray.exists():
        pytest.fail(f"{ray} missing (ray[serve] installs it)")
    out = subprocess.run(
        [str(ray), "health-check", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "--address" in out.stdout, out.stderr
