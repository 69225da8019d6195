"""A venv with upstream Twinkle (twinkle-kit 0.5.1) where OUR twinkle_client replaces upstream's:
the "swap-in" check that upstream's cookbook scripts (``from twinkle import init_twinkle_client``,
``from twinkle_client.model import MultiLoraTransformersModel``, ``from twinkle_client.sampler
import vLLMSampler``) run with our client installed instead of theirs.

``<repo>/.cache/twinkle-kit-0.5.1-ours/`` = the upstream venv's site-packages
(``<repo>/.cache/twinkle-kit-0.5.1``, built by tests/compat/venv.py when that module is present)
minus upstream's ``twinkle_client``, plus ours (``pip install --no-deps --target <site>
<repo>/client``). Without tests/compat/venv.py and without an upstream venv, a minimal one is
built the same way: a ``--without-pip`` venv, a .pth after its own site-packages pointing at the
project venv's, ``pip install --no-deps --target <site> twinkle-kit==0.5.1 tinker==0.16.1``
(wheels from ``<repo>/.cache/wheels`` when cached). The project venv is never changed. Rebuilt on
every call (a copy of ~10 MB: cheap, and never stale against the client's source).

    python tests/compat/swap_venv.py [--upstream-venv DIR]   # build, check, print its python
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UPSTREAM_NAME = "twinkle-kit-0.5.1"
OURS_NAME = "twinkle-kit-0.5.1-ours"
MINIMAL_PINS = ("twinkle-kit==0.5.1", "tinker==0.16.1")
SWAP_CHECK = (
    "from twinkle import init_twinkle_client; "
    "from twinkle_client.model import MultiLoraTransformersModel; "
    "from twinkle_client.sampler import vLLMSampler; "
    "from twinkle_client.rollout import ClientMultiTurnRollout; "
    "import twinkle_client, twinkle; "
    "print(twinkle_client.__file__); print(twinkle_client.__version__)"
)


def _site(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python*/site-packages"))
    if not found:
        raise RuntimeError(f"{venv}: no lib/python*/site-packages")
    return found[0]


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, timeout=900)


def _new_venv(venv: Path) -> Path:
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return _site(venv)


def build_minimal_upstream(repo: Path = REPO) -> Path:
    """twinkle-kit 0.5.1 + tinker 0.16.1 over the project venv (no data-side extras)."""
    venv = repo / ".cache" / UPSTREAM_NAME
    site = _new_venv(venv)
    (site / "zz_project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheels = repo / ".cache" / "wheels"
    source = ["--no-index", "--find-links", str(wheels)] if wheels.is_dir() else []
    try:
        _pip("install", "-q", "--no-deps", *source, "--target", str(site), *MINIMAL_PINS)
    except subprocess.CalledProcessError:
        if not source:
            raise
        _pip("install", "-q", "--no-deps", "--target", str(site), *MINIMAL_PINS)  # from PyPI
    shutil.rmtree(site / "bin", ignore_errors=True)
    return venv


def upstream_venv(repo: Path = REPO) -> Path:
    """The upstream venv: tests/compat/venv.py's when that module exists, else an existing
    ``<repo>/.cache/twinkle-kit-0.5.1``, else a minimal one built here."""
    try:
        from tests.compat.venv import compat_python  # pyright: ignore[reportMissingImports]
    except ImportError:
        venv = repo / ".cache" / UPSTREAM_NAME
        if (venv / "pyvenv.cfg").is_file() and any(venv.glob("lib/python*/site-packages/twinkle")):
            return venv
        return build_minimal_upstream(repo)
    return Path(compat_python(repo)).parent.parent


def build_swap_venv(repo: Path = REPO, upstream: Path | None = None) -> Path:
    """Build ``<repo>/.cache/twinkle-kit-0.5.1-ours`` and return its python."""
    src_site = _site(upstream or upstream_venv(repo))
    venv = repo / ".cache" / OURS_NAME
    site = _new_venv(venv)
    for entry in src_site.iterdir():
        if entry.name in ("twinkle_client", "__pycache__") or entry.name.startswith(
            ("twinkle_client-", "twinkle_client.")
        ):
            continue
        if entry.is_dir():
            shutil.copytree(entry, site / entry.name, symlinks=True)
        else:
            shutil.copy2(entry, site / entry.name)
    _pip(
        "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site),
        str(repo / "client"),
    )  # fmt: skip
    shutil.rmtree(site / "bin", ignore_errors=True)
    return venv / "bin" / "python"


def check_swap(python: Path) -> str:
    """Run upstream's cookbook imports in the swapped venv; returns what it printed (our
    twinkle_client's file and version). Raises if an import fails or upstream's client loads."""
    out = subprocess.run(
        [str(python), "-c", SWAP_CHECK], capture_output=True, text=True, timeout=300, cwd="/"
    )
    if out.returncode != 0:
        raise RuntimeError(f"swap-in imports failed:\n{out.stderr[-2000:]}")
    where = out.stdout.splitlines()[0]
    if OURS_NAME not in where:
        raise RuntimeError(f"twinkle_client came from {where}, not the swapped venv")
    return out.stdout


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream-venv", type=Path, help="use this upstream venv (not rebuilt)")
    ns = ap.parse_args()
    py = build_swap_venv(REPO, ns.upstream_venv)
    print(check_swap(py), end="")
    print(py)
