"""Reads an engine step timeline (KUBESGL_STEP_LOG, engine/step_log.py) and summarises each burst of requests:
when its prefills were done, and how fast its prefill steps ran while requests were still arriving against
after the last one arrived. A burst is a run of steps after a pause of more than `--gap` seconds; its prefill
phase ends with its last extend step. Prints a table, asserts nothing.

    python3 benchmark/step_bursts.py steps.jsonl[.gz] [--gap 1.0] [--min-requests 32]

"arriving" counts the extend steps whose scheduler saw more requests (running + waiting) after them than after
the step before; "after" the rest. A served burst reaches its engine over the client's send and the gateways'
per-request work, an offline one (LLM.generate on every request at once) all at t = 0.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from typing import Any

_DECODE_RUN = 10  # this many decode steps in a row end a burst's prefill phase


def bursts(steps: list[dict[str, Any]], gap_s: float) -> list[list[dict[str, Any]]]:
    """The timeline cut into prefill phases: from an extend step to the last extend before a pause of more than
    `gap_s` or a run of _DECODE_RUN decode steps, plus the step after it (its start ends the last one's period).
    A served engine runs a few decodes between arrivals; a burst's own decoding is hundreds of steps."""
    out: list[list[dict[str, Any]]] = []
    first = last = None
    decodes = 0
    for i, s in enumerate(steps):
        if first is not None and s["t"] - steps[i - 1]["t"] > gap_s:
            out.append(steps[first : last + 2])
            first = None
        if s["mode"] == "decode":
            decodes += 1
            if first is not None and decodes >= _DECODE_RUN:
                out.append(steps[first : last + 2])
                first = None
            continue
        decodes = 0
        if first is None:
            first = i
        last = i
    if first is not None:
        out.append(steps[first : last + 2])
    return out


def ms_per_8k(steps: list[tuple[dict[str, Any], float]]) -> float | None:
    """Mean step period (to the next step's start) scaled to 8192 new tokens."""
    tokens = sum(s["tokens"] for s, _ in steps)
    return 1e3 * sum(p for _, p in steps) * 8192 / tokens if tokens else None


def summary(burst: list[dict[str, Any]], min_requests: int) -> dict[str, Any] | None:
    ext = [i for i, s in enumerate(burst) if s["mode"] != "decode"]
    big = [i for i in ext if burst[i]["tokens"] >= 256]
    if not big or len(burst) < 2 or max(s["running"] + s["waiting"] for s in burst) < min_requests:
        return None
    first, last = big[0], ext[-1]
    ext = [i for i in ext if first <= i <= last]
    t0 = burst[first]["t"]
    end = burst[last + 1]["t"] if last + 1 < len(burst) else burst[last]["t"]
    arriving, after = [], []
    seen = 0
    for i in ext:
        if i + 1 >= len(burst):
            continue
        s = burst[i]
        period = burst[i + 1]["t"] - s["t"]
        total = s["running"] + s["waiting"]
        (arriving if total > seen else after).append((s, period))
        seen = max(seen, total)
    decodes_between = sum(1 for i in range(first, last) if burst[i]["mode"] == "decode")
    return {
        "requests": seen,
        "first_step_waiting": burst[first]["waiting"],
        "prefill_tokens": sum(burst[i]["tokens"] for i in ext),
        "prefills_done_ms": round(1e3 * (end - t0), 1),
        "extend_steps": len(ext),
        "decode_steps_between": decodes_between,
        "arriving_steps": len(arriving),
        "arriving_ms_per_8k": ms_per_8k(arriving),
        "after_steps": len(after),
        "after_ms_per_8k": ms_per_8k(after),
        "first_steps_ms": [
            round(1e3 * (burst[i + 1]["t"] - burst[i]["t"]), 1) for i in big[:3] if i + 1 < len(burst)
        ],
        "launch_ms_median": statistics.median(burst[i]["launch_ms"] for i in ext),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("steps")
    p.add_argument("--gap", type=float, default=1.0, help="seconds without a step that end a burst")
    p.add_argument("--min-requests", type=int, default=32, help="smaller phases are not bursts")
    args = p.parse_args()
    with (gzip.open if args.steps.endswith(".gz") else open)(args.steps, "rt", encoding="utf-8") as f:
        steps = sorted((json.loads(line) for line in f if line.strip()), key=lambda s: s["t"])
    for n, burst in enumerate(bursts(steps, args.gap)):
        s = summary(burst, args.min_requests)
        if s is None:
            continue
        fmt = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.items()}
        print(f"burst {n}: " + ", ".join(f"{k} {v}" for k, v in fmt.items()))


if __name__ == "__main__":
    main()
