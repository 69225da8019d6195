"""A venv with upstream Twinkle's client (PyPI `twinkle-kit`) for running upstream's cookbook
scripts against `twinkle serve`.

Same pattern as tests/e2e/test_old_sdk.py: `<repo>/.cache/twinkle-kit-<version>/` is a
`--without-pip` venv whose site-packages holds, installed with pip `--no-deps --target`, only
what differs from or is missing in the project venv (upstream's client, its patched tinker SDK,
and the data-side packages its local `twinkle` imports); everything else (torch, transformers,
peft, numpy, requests, pydantic, ...) comes from the project venv through a .pth file placed
after the venv's own site-packages. The project venv itself is never changed.

Idempotent: a `.ready` marker records the pins it was built with; a change of PINS rebuilds.
Wheels are downloaded once into `<repo>/.cache/wheels` (then installed from there with
--no-index), so a rebuild works offline once the wheels are cached.

    python -m tests.compat.venv          # build (or reuse) and print the venv's python
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TWINKLE_KIT_VERSION = "0.5.1"

# Every package installed into the compat venv, pinned (the one place for versions). Each is
# installed --no-deps; the rest of their requirements come from the project venv.
PINS: dict[str, str] = {
    # upstream's client: packages `twinkle`, `twinkle_client`
    "twinkle-kit": TWINKLE_KIT_VERSION,
    # the Tinker SDK version that twinkle-kit's `init_tinker_client()` patches (the project venv
    # has a newer one; this copy shadows it)
    "tinker": "0.16.1",
    # `twinkle/__init__` and `twinkle.dataset` import these (the project venv lacks them)
    "datasets": "5.2.0",
    "pyarrow": "26.0.1",
    "dill": "0.4.1",
    "multiprocess": "0.70.19",
    "xxhash": "4.1.0",
    "pandas": "3.1.1",
    "python-dateutil": "2.9.0.post0",
    "omegaconf": "2.4.0",
    # `twinkle.hub` (ms:// resolution) and the tinker cookbook's `from modelscope import ...`
    "modelscope": "1.40.2",
    "modelscope-hub": "0.5.1",
    # `twinkle.sampler` / `twinkle.utils` import zmq at module level
    "pyzmq": "27.3.0",
    # `twinkle.template` / `twinkle.dataset` import PIL (multimodal helpers)
    "pillow": "13.0.0",
    # twinkle/short_math_grpo.py does `import swanlab` (only used when USE_SWANLAB, which is
    # False); installed so the import needs no substitution. The rest is what its import needs.
    "swanlab": "0.10.3",
    "pyroaring": "1.0.3",
    "watchdog": "7.1.0",
    "pydantic-settings": "2.16.3",
    "pyecharts": "2.1.0",
    "simplejson": "4.3.0",
    "prettytable": "3.19.0",
}


class CompatVenvUnavailable(RuntimeError):
    """The packages could not be downloaded (PyPI unreachable) and are not cached."""


def venv_dir(repo: Path = REPO) -> Path:
    return repo / ".cache" / f"twinkle-kit-{TWINKLE_KIT_VERSION}"


def _pins_text() -> str:
    return "".join(f"{name}=={version}\n" for name, version in sorted(PINS.items()))


def compat_python(repo: Path = REPO, *, quiet: bool = True) -> Path:
    """The compat venv's python, building the venv first if needed."""
    venv = venv_dir(repo)
    py = venv / "bin" / "python"
    marker = venv / ".ready"
    if marker.exists() and py.exists() and marker.read_text() == _pins_text():
        return py
    if venv.exists():
        shutil.rmtree(venv)
    wheels = repo / ".cache" / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    specs = [f"{n}=={v}" for n, v in sorted(PINS.items())]
    q = ["-q"] if quiet else []
    dl = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", *q, "-d", str(wheels), *specs],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if dl.returncode != 0:
        raise CompatVenvUnavailable(
            f"could not download {' '.join(specs)} (PyPI unreachable and not cached): "
            f"{dl.stderr[-500:]}"
        )
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # The project venv's packages, after the compat venv's own (so tinker 0.16.1 shadows the
    # project's tinker).
    Path(site, "zz_project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            *q,
            "--no-deps",
            "--no-index",
            "--find-links",
            str(wheels),
            "--target",
            site,
            *specs,
        ],
        check=True,
        timeout=900,
    )
    # pip --target also writes console scripts into <site>/bin; harmless, but keep the tree tidy.
    shutil.rmtree(Path(site, "bin"), ignore_errors=True)
    marker.write_text(_pins_text())
    return py


if __name__ == "__main__":
    try:
        print(compat_python(quiet=False))
    except CompatVenvUnavailable as exc:
        sys.exit(str(exc))
