"""The seed workload's step schedule with and without mixed chunks, from the real Scheduler on the host (CPU).

No model runs: every sampled token stands in as token 7 (EOS is ignored, as in `kubesgl bench offline`, so the
tokens' values change nothing), and steps are applied one behind, as overlap scheduling does. What this measures
exactly is the schedule: steps by kind, the decode rows a mixed step carries, and the rows left to decode steps;
what those steps cost is the device's (`kernel_trace.py --mixed-decode`, `device_run.sh mixed`).

    python benchmark/mixed_chunk_schedule.py [--max-prefill-length 8192]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from kubesgl.bench.offline import add_arguments, make_workload
from kubesgl.engine.plan import StepTokens
from kubesgl.engine.scheduler import Scheduler, SchedulerLimits
from kubesgl.kv.page_pool import PagePool
from kubesgl.kv.radix import RadixCache
from kubesgl.values.sampling import SamplingParams

QWEN3_VOCAB, QWEN3_CONTEXT, PAGES = (
    151936,
    40960,
    200_000,
)  # the H200 holds ~2 M tokens of 0.6B KV: no pressure


def schedule(args: argparse.Namespace, mixed: bool) -> dict[str, object]:
    prompts, max_tokens = make_workload(args)
    limits = SchedulerLimits(
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_length,
        context_len=QWEN3_CONTEXT,
        vocab_size=QWEN3_VOCAB,
        eos_token_ids=(),
        enable_mixed_chunk=mixed,
    )
    pool = PagePool(PAGES, args.page_size)
    sched = Scheduler(limits, pool, RadixCache(args.page_size, pool))
    for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        sched.add_request(
            str(i), p, SamplingParams(max_tokens=n, temperature=args.temperature, ignore_eos=True)
        )
    decode_rows: Counter[int] = Counter()  # decode-step batch sizes
    inflight = None
    while sched.has_work() or inflight is not None:
        launched = sched.schedule()
        if launched is not None and launched[0].mode == "decode":
            decode_rows[launched[0].batch_size] += 1
        if inflight is not None:
            plan, reqs = inflight
            sched.process(plan, reqs, StepTokens([7 if s else -1 for s in plan.sample], [None] * len(reqs)))
        inflight = launched
    return {
        "mixed_chunk": mixed,
        **{f"steps_{k}": sched.counters.steps[k] for k in ("extend", "mixed", "decode")},
        "mixed_decode_rows": sched.counters.mixed_decode_rows,
        "decode_step_rows": sum(b * n for b, n in decode_rows.items()),
        "decode_steps_at_256": decode_rows[args.max_running_requests],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args()
    for mixed in (False, True):
        print(json.dumps(schedule(args, mixed)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
