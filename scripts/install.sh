#!/usr/bin/env bash
# Create .venv/ at the repo root with the `twinkle` command, reproducibly (constraints.txt).
# torch goes in first as the CPU build so nothing later pulls a multi-GB CUDA build.
# Idempotent: skips work when .venv matches constraints.txt + pyproject files.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
# System services the tests and a multi-replica gateway use: redis-server (Postgres 15 ships with
# these machines), and Debian's prometheus (the server and promtool) for the observability tests
# (infra/observability/). Installed with apt when missing and we may (root or sudo); 6 s + 10 s.
APT=()
command -v redis-server >/dev/null || APT+=(redis-server)
command -v curl >/dev/null || APT+=(curl)   # infra/terraform/modules/twinkle-host's health probe
{ command -v prometheus >/dev/null && command -v promtool >/dev/null; } || APT+=(prometheus)
if [[ ${#APT[@]} -gt 0 ]]; then
  SUDO=(); [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null && SUDO=(sudo -n)
  if [[ $(id -u) -eq 0 || ${#SUDO[@]} -gt 0 ]] && command -v apt-get >/dev/null; then
    echo "[install] apt-get install ${APT[*]}" >&2
    # another apt run (unattended upgrades, a parallel install) may hold the lock: wait for it
    APT_GET=("${SUDO[@]}" apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends)
    "${APT_GET[@]}" "${APT[@]}" >/dev/null 2>&1 \
      || { "${SUDO[@]}" apt-get update -q >/dev/null && "${APT_GET[@]}" "${APT[@]}" >/dev/null; }
  else
    echo "[install] warning: ${APT[*]} missing and apt-get unavailable; their tests will skip" >&2
  fi
fi
# Chromium for the admin console's browser test (tests/console/test_console_browser.py): Debian's
# package, driven by Playwright, which then downloads no browser of its own; about 40-60 s once.
# Without root or sudo it is skipped (the test skips too, except under CI=1, where it must run).
if ! command -v chromium >/dev/null; then
  SUDO=(); [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null && SUDO=(sudo -n)
  if [[ $(id -u) -eq 0 || ${#SUDO[@]} -gt 0 ]] && command -v apt-get >/dev/null; then
    echo "[install] apt-get install chromium" >&2
    "${SUDO[@]}" apt-get install -y -q chromium >/dev/null 2>&1 \
      || { "${SUDO[@]}" apt-get update -q >/dev/null && "${SUDO[@]}" apt-get install -y -q chromium >/dev/null; }
  elif [[ -n ${CI:-} ]]; then
    echo "[install] error: chromium missing and apt-get unavailable (needed under CI)" >&2
    exit 1
  else
    echo "[install] warning: chromium missing and apt-get unavailable; the console browser test will skip" >&2
  fi
fi
# Terraform, its null provider, python-hcl2 and checkov for tests/infra, in .tools/ (own stamp).
bash scripts/install_infra_tools.sh
STAMP=.venv/.twinkle-installed
WANT=$(cat constraints.txt pyproject.toml client/pyproject.toml | sha256sum | cut -c1-16)
if [[ -f $STAMP && $(cat $STAMP) == "$WANT" && -x .venv/bin/twinkle ]]; then
  exit 0
fi
echo "[install] creating .venv with $($PY --version)" >&2
[[ -d .venv ]] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
FIND=()
[[ -d /opt/wheels ]] && FIND=(--find-links /opt/wheels)   # the provisioned torch CPU wheel
TORCH=$(grep -E '^torch==' constraints.txt)
"${PIP[@]}" install "${FIND[@]}" "$TORCH"
"${PIP[@]}" install "${FIND[@]}" -c constraints.txt -e '.[dev,megatron]' -e ./client
.venv/bin/python -c 'import torch; assert torch.__version__.startswith("2.13"), torch.__version__'
echo "$WANT" > $STAMP
echo "[install] done: .venv/bin/twinkle" >&2
