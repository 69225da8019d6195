"""Print every .tf file of a folder as JSON, parsed by python-hcl2 (run by tests/infra/tools.py
with the tools venv's Python; hcl2 is not in .venv). python-hcl2 8 keeps string quotes and
`__is_block__` markers; both are removed so tests see plain values."""

import json
import sys
from pathlib import Path

import hcl2


def clean(value):
    if isinstance(value, dict):
        return {clean(k): clean(v) for k, v in value.items() if k != "__is_block__"}
    if isinstance(value, list):
        return [clean(v) for v in value]
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


folder = Path(sys.argv[1])
json.dump(
    {p.name: clean(hcl2.loads(p.read_text())) for p in sorted(folder.glob("*.tf"))}, sys.stdout
)
