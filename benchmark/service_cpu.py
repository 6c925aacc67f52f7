"""Every service process's CPU time under a `kubesgl up`, read from /proc (no psutil on the device), so a
device run can say which process caps the serving path: on a host with a core per service, the one near a
full core.

    python3 benchmark/service_cpu.py snapshot UP_PID LABEL >> cpu.jsonl    # before and after each bench run
    python3 benchmark/service_cpu.py summary cpu.jsonl serve.jsonl        # per run: CPU us per output token
    python3 benchmark/service_cpu.py spy UP_PID OUT_DIR NAME...           # a burst hook: py-spy on those services

`spy`, run as `kubesgl bench serve --burst-hook` with BURST_PHASE=start, starts py-spy (GIL samples, not pausing
the process) on each named service (`scheduler:8100`, `gateway:8000`, ...) for SPY_SECONDS (default 6) and
returns at once; each writes OUT_DIR/burst_<name>.pyspy and its own output to burst_<name>.log. At BURST_PHASE=end
it does nothing.

`summary` pairs the snapshots in order (before, after, before, after, ...) with serve.jsonl's lines (one per
`kubesgl bench serve` run, in the same order) and divides each process's CPU by the run's output tokens; a
process's share of one core over the run's wall time is printed beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of `pid`, or None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) * _TICK_S


def _name(pid: int) -> str:
    """`gateway:8001`, `detokenizer:8101`, `nats-server`, ...: the service kind and its port."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return str(pid)
    if "kubesgl.cli" in argv:
        kind = argv[argv.index("kubesgl.cli") + 1]
        for flag in ("--port", "--admin-port"):
            if kind != "up" and flag in argv:
                return f"{kind}:{argv[argv.index(flag) + 1]}"
        return "launcher" if kind == "up" else kind
    return os.path.basename(argv[0]) or str(pid)


def _tree(root: int) -> dict[int, tuple[str, float]]:
    """Every process under `root` (itself included): its name and its CPU seconds so far."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            parents[int(entry)], cpu[int(entry)] = st
    under = {root}
    for _ in range(8):  # `timeout` -> launcher -> services (a scheduler's TP ranks one level deeper)
        under |= {pid for pid, parent in parents.items() if parent in under}
    names = {p: _name(p) for p in under if p in parents}
    # A multiprocessing child (the scheduler's engine process, its TP ranks) is named by its parent, parents first.
    for p in sorted(names):
        if names[p] in ("python", "python3") and parents[p] in names:
            names[p] = f"{names[parents[p]]} child {p}"
    return {p: (names[p], cpu[p]) for p in sorted(names)}


def snapshot(root: int, label: str) -> dict[str, object]:
    return {
        "label": label,
        "t": time.time(),
        "cpu_s": {name: round(s, 3) for name, s in _tree(root).values()},
    }


def summary(cpu_path: str, serve_path: str) -> None:
    snaps = [json.loads(line) for line in Path(cpu_path).read_text().splitlines() if line.strip()]
    runs = [json.loads(line) for line in Path(serve_path).read_text().splitlines() if line.strip()]
    for (before, after), run in zip(zip(snaps[::2], snaps[1::2], strict=False), runs, strict=False):
        tokens = run["output_tokens"]
        print(f"{after['label']}: {run['gateways']} gateway(s), {run['output_tok_s']} tok/s, {tokens} tokens")
        for name, s in after["cpu_s"].items():
            used = s - before["cpu_s"].get(name, 0.0)
            per_token, cores = 1e6 * used / max(tokens, 1), used / run["seconds"]
            print(f"  {name:<22} {per_token:8.1f} us/token  {cores:5.2f} cores")


def spy(root: int, out_dir: str, names: list[str]) -> None:
    if os.environ.get("BURST_PHASE") != "start":
        return
    procs = {name: pid for pid, (name, _) in _tree(root).items() if name in names}
    for name in names:
        if name not in procs:
            print(f"service_cpu spy: no {name} under {root}", file=sys.stderr)
            continue
        out = Path(out_dir) / f"burst_{name.replace(':', '_')}"
        cmd = ["py-spy", "record", "--gil", "--nonblocking", "-r", "250", "-f", "raw", "-o", f"{out}.pyspy"]
        cmd += ["-d", os.environ.get("SPY_SECONDS", "6"), "-p", str(procs[name])]
        try:  # its own log beside its samples: a py-spy that cannot attach says why there
            with open(f"{out}.log", "w") as log:
                subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        except FileNotFoundError:  # the burst runs on: its CPU snapshots are the hook's other half
            print(
                "service_cpu spy: no py-spy on PATH (carry its wheel in .whl: device_wheels.sh)",
                file=sys.stderr,
            )
            return


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "spy":
        spy(int(sys.argv[2]), sys.argv[3], sys.argv[4:])
    elif len(sys.argv) == 4 and sys.argv[1] == "snapshot":
        print(json.dumps(snapshot(int(sys.argv[2]), sys.argv[3])), flush=True)
    elif len(sys.argv) == 4 and sys.argv[1] == "summary":
        summary(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
