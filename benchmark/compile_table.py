"""The table of device_run.sh's compile25 mode: offline figures and kernel-trace steps, torch.compile off/on.

python benchmark/compile_table.py OUT/compile25.jsonl OUT/trace25.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(path: str) -> list[dict]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def mode(r: dict) -> str:
    if not r.get("torch_compile"):
        return "off"
    kind = "dynamic" if r.get("torch_compile_dynamic") else "static"
    return f"on ({kind}, bs <= {r['torch_compile_max_bs']}, {r['torch_compile_compiles']} compiles)"


def main(offline: str, trace: str) -> int:
    print(f"{'offline':<44} {'tok/s':>9} {'ratio':>6} {'startup s':>9} {'capture s':>9} {'compile s':>9}")
    for r in rows(offline):
        print(
            f"{mode(r):<44} {r['output_tok_s']:>9} {r['ratio_to_ceiling']!s:>6} {r['startup_s']:>9} "
            f"{r['graph_capture_s']:>9} {r.get('torch_compile_s', 0.0):>9}"
        )
    print(
        f"\n{'kernel trace':<44} {'bs':>4} {'ms/step':>8} {'kernels/step':>12} {'kernel ms':>9} {'compile s':>9}"
    )
    for r in rows(trace):
        if "bs" in r:
            print(
                f"{mode(r):<44} {r['bs']:>4} {r['step_ms']:>8} {r['ops_per_step']:>12} "
                f"{r['kernel_ms_per_step']:>9} {r.get('torch_compile_s', 0.0):>9}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
