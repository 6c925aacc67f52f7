"""The table of device_run.sh's `levers25` mode: the kernel levers off and on, from the same call's JSON lines.

    python benchmark/kernel_levers.py $OUT    # reads trace_{off,pdl,pdl_mlp}.jsonl, bench_{off,all}.jsonl

Decode step (kernel_trace.py: ms per steady decode step inside the graph, device ops per step) per batch size
with every lever off, with programmatic dependent launch (kernels/pdl.py), and with PDL plus the fused decode
MLP (kernels/fused_mlp.py); then the offline benchmark's output tok/s and ratio to its ceiling, all off vs all on.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

TRACES = {"off": "all off", "pdl": "PDL", "pdl_mlp": "PDL + fused MLP"}
BENCHES = {"off": "all off", "all": "all on"}


def rows(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def step_cell(r: dict[str, Any] | None) -> str:
    return f"{r['step_ms']:.3f} ({r['ops_per_step']:.0f})" if r else "-"


def main(out: str) -> int:
    print("==== levers25: the kernel levers, same call ====")
    by_bs = {
        name: {r["bs"]: r for r in rows(os.path.join(out, f"trace_{name}.jsonl")) if "bs" in r}
        for name in TRACES
    }
    print("decode step, ms (device ops per step)")
    print(f"{'bs':>5}" + "".join(f"{label:>18}" for label in TRACES.values()))
    for bs in sorted({bs for r in by_bs.values() for bs in r}):
        print(f"{bs:>5}" + "".join(f"{step_cell(by_bs[name].get(bs)):>18}" for name in TRACES))
    print("offline, output tok/s (ratio to the run's ceiling)")
    for name, label in BENCHES.items():
        for r in rows(os.path.join(out, f"bench_{name}.jsonl")):
            print(f"{label:>10}: {r['output_tok_s']:,.0f} ({r['ratio_to_ceiling']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp/out")))
