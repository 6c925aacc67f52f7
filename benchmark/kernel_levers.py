"""The table of device_run.sh's `levers25` mode: each kernel lever off and on, from the same call's JSON lines.

    python benchmark/kernel_levers.py $OUT    # reads trace_pdl_{off,on}.jsonl, bench_pdl_{off,on}.jsonl

Decode step (kernel_trace.py: ms per steady decode step inside the graph, device ops per step) per batch size,
and the offline benchmark's output tok/s and ratio to its ceiling, with programmatic dependent launch
(kernels/pdl.py) off (KUBESGL_DISABLE_PDL=1) and on.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def rows(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(out: str) -> int:
    print("==== levers25: programmatic dependent launch off -> on (same call) ====")
    traces = {state: rows(os.path.join(out, f"trace_pdl_{state}.jsonl")) for state in ("off", "on")}
    by_bs = {state: {r["bs"]: r for r in rs if "bs" in r} for state, rs in traces.items()}
    print(f"{'decode step':>14} {'off ms (ops)':>16} {'on ms (ops)':>16} {'saved':>8}")
    for bs in sorted(set(by_bs["off"]) | set(by_bs["on"])):
        off, on = by_bs["off"].get(bs), by_bs["on"].get(bs)
        cells = [f"{r['step_ms']:.3f} ({r['ops_per_step']:.0f})" if r else "-" for r in (off, on)]
        saved = f"{off['step_ms'] - on['step_ms']:+.3f}" if off and on else "-"
        print(f"{'bs ' + str(bs):>14} {cells[0]:>16} {cells[1]:>16} {saved:>8}")
    print(f"{'offline':>14} {'off tok/s (ratio)':>18} {'on tok/s (ratio)':>18}")
    benches = {state: rows(os.path.join(out, f"bench_pdl_{state}.jsonl")) for state in ("off", "on")}
    for i in range(max(len(b) for b in benches.values())):
        cells = []
        for state in ("off", "on"):
            r = benches[state][i] if i < len(benches[state]) else None
            cells.append(f"{r['output_tok_s']:,.0f} ({r['ratio_to_ceiling']:.3f})" if r else "-")
        print(f"{'run ' + str(i + 1):>14} {cells[0]:>18} {cells[1]:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp/out")))
