"""Upstream Twinkle's own cookbook client scripts (modelscope/twinkle, run with upstream's client
`twinkle-kit==0.5.1` and its patched tinker 0.16.1) against our `twinkle serve`, offline.

Skeleton: one case per script id in tests/compat/substitutions.py; each fetches the script from an
upstream checkout (TWINKLE_UPSTREAM_REPO), applies the marked substitutions (tiny model, local
data, capped steps) and runs it with tests/compat/run_upstream.py. How to run one by hand and
what each substitution is for: tests/compat/README.md.

Each twinkle script also runs with OUR twinkle_client in place of upstream's (upstream's
`twinkle` package kept for the data side: tests/compat/swap_venv.py).

Skips (saying why) when there is no upstream checkout (CI has none: no GitHub there; the same
calls run in CI through our own flows, tests/e2e/test_upstream_client.py), or when PyPI is
unreachable and the compat venv's wheels are not cached.
"""

from __future__ import annotations

import pytest

from tests.compat.run_upstream import HarnessError, apply_substitutions, fetch_script, run_script
from tests.compat.substitutions import SCRIPTS
from tests.compat.venv import CompatVenvUnavailable, compat_python

pytestmark = pytest.mark.e2e


def _script_text(script_id: str) -> str:
    try:
        return fetch_script(script_id)[0]
    except HarnessError as exc:
        pytest.skip(f"upstream's cookbook script is not available: {exc}")


@pytest.fixture(scope="session")
def compat_py() -> str:
    try:
        return str(compat_python())
    except CompatVenvUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("script_id", list(SCRIPTS))
def test_substitutions_still_match(script_id: str):
    """Cheap (no server): every marked substitution still matches upstream's script exactly."""
    text = _script_text(script_id)
    values = {
        "DATA": "/data",
        "ADAPTER": "twinkle://run/weights/x",
        "SAMPLER_PATH": "twinkle://run/sampler_weights/x",
    }
    patched = apply_substitutions(script_id, text, values, log=lambda _line: None)
    compile(patched, f"{script_id}.py", "exec")  # still valid Python


@pytest.fixture(scope="session")
def ours_py(compat_py: str) -> str:
    """The compat venv with our twinkle_client swapped in for upstream's."""
    from tests.compat.swap_venv import build_swap_venv

    return str(build_swap_venv())


CASES = [(sid, "upstream") for sid in SCRIPTS] + [
    (sid, "ours") for sid in SCRIPTS if sid.startswith("twinkle/")
]


@pytest.mark.parametrize("script_id,client", CASES)
def test_upstream_cookbook_script_runs(script_id: str, client: str, server, request):
    _script_text(script_id)  # skip early when upstream's checkout is missing
    python = request.getfixturevalue("compat_py" if client == "upstream" else "ours_py")
    key = server.create_key(f"compat-{client}-{script_id.replace('/', '-')}")
    lines: list[str] = []
    rc = run_script(script_id, server.url, key, python=python, timeout=300, log=lines.append)
    assert rc == 0, "\n".join(lines[-60:])
