"""Seconds per test file from a pytest JUnit XML report, slowest first, and how many servers and
Ray clusters the suite started (CI prints this after the suite so the time budget is visible per
layer).

    python scripts/test_times.py report.xml [--top N]
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    per_file: dict[str, float] = collections.defaultdict(float)
    report = ET.parse(a.report)
    for case in report.iter("testcase"):
        module = case.get("classname", "").split("::")[0]
        path = "/".join(p for p in module.split(".") if not p[:1].isupper()) + ".py"
        per_file[path] += float(case.get("time", 0) or 0)
    total = sum(per_file.values())
    layers: dict[str, float] = collections.defaultdict(float)
    for path, secs in per_file.items():
        layers["/".join(path.split("/")[:2])] += secs
    print(f"[ci] test time {total / 60:.1f} min; by folder:")
    for layer, secs in sorted(layers.items(), key=lambda kv: -kv[1]):
        print(f"  {secs:7.1f} s  {layer}")
    cookbook = sum(s for p, s in per_file.items() if "cookbook" in p)
    print(f"  {cookbook:7.1f} s  (the cookbook layer: tests/e2e/test_*cookbook*)")
    # recorded by tests/conftest.py from tests/launch.py's counts
    starts = {p.get("name", ""): p.get("value") for p in report.iter("property")}
    print(
        f"[ci] twinkle serve started {starts.get('starts: twinkle serve', 0)} times "
        f"(Ray clusters: {starts.get('starts: ray cluster', 0)}; "
        f"cookbook launchers: {starts.get('starts: launcher', 0)})"
    )
    print(f"[ci] slowest {a.top} files:")
    for path, secs in sorted(per_file.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"  {secs:7.1f} s  {path}")


if __name__ == "__main__":
    main()
