"""What is allocated at the peak of a step, and what the memory holding it reserves: a rank's CUDA graph pool against
its baseline's eager allocator, grouped by the innermost frame of timm, a model or lightning_spatial that allocated.

    python tools/memory_peak.py --out DIR -- [benchmarks/trainer_step.py's arguments]

runs ``benchmarks/trainer_step.py`` with the CUDA allocator's history recorded for each fit (the baseline's, then the
rank's) and writes ``DIR/memory_peak.json``: per fit, the peak of what was allocated since the fit began, in the
graphs' pools and outside them, the pools' reserved size, and what was alive at each peak, by frame. A pool
reserving more than its peak holds segments it never fills at once (fragmentation); the frames say what a rank
keeps that its baseline does not.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import sys

MARK = 7_777_777  # bytes of the allocation that marks where a fit's events begin


def _frame(frames: list[dict]) -> str:
    """The innermost frame in timm, a model or lightning_spatial (not the graphs' own), with the op's name."""
    op = frames[0]["name"] if frames else "?"
    for f in frames:
        path = f["filename"]
        if any(part in path for part in ("timm/", "lightning_spatial/", "/models/")) and "graphs.py" not in path:
            short = path.split("site-packages/")[-1].split("lightning_spatial/")[-1]
            return f"{op} @ {short}:{f['line']} {f['name']}"
    return f"{op} @ " + " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}" for f in frames[:3])


def peaks(snapshot: dict) -> dict:
    """From ``torch.cuda.memory._snapshot()``: per place ("pool": the graphs' private pools, "eager": the rest), the
    peak MiB allocated after the last marker allocation and what was alive then, by frame (MiB, count); and the
    pools' reserved MiB."""
    events = snapshot["device_traces"][0]
    marks = [i for i, e in enumerate(events) if e["action"] == "alloc" and abs(e["size"] - MARK) < 4096]
    events = events[marks[-1] + 1 :] if marks else events
    pools = sorted(
        (s["address"], s["address"] + s["total_size"])
        for s in snapshot["segments"]
        if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)
    )
    starts = [lo for lo, _ in pools]

    def in_pool(address: int) -> bool:
        i = bisect.bisect_right(starts, address) - 1
        return i >= 0 and address < pools[i][1]

    out: dict = {"pool_reserved_mib": round(sum(hi - lo for lo, hi in pools) / 2**20, 1)}
    for place in ("pool", "eager"):
        live: dict[int, dict] = {}
        now = peak = 0
        at_peak: list[dict] = []
        for e in events:
            if e["action"] == "alloc" and in_pool(e["addr"]) == (place == "pool"):
                live[e["addr"]] = e
                now += e["size"]
                if now > peak:
                    peak, at_peak = now, list(live.values())
            elif e["action"] == "free_requested" and e["addr"] in live:
                now -= live.pop(e["addr"])["size"]
        groups: collections.Counter = collections.Counter()
        counts: collections.Counter = collections.Counter()
        for e in at_peak:
            key = _frame(e.get("frames", []))
            groups[key] += e["size"]
            counts[key] += 1
        out[f"{place}_peak_mib"] = round(peak / 2**20, 1)
        out[f"{place}_at_peak"] = {k: [round(v / 2**20, 1), counts[k]] for k, v in groups.most_common(40)}
    return out


def main() -> None:
    import torch
    from wrapped_step import fit_name, trainer_step_from_cli

    out, trainer_step = trainer_step_from_cli(__doc__)
    fits = []
    measure = trainer_step.measure

    def recorded(step_args, plugins):
        torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python", max_entries=3_000_000)
        torch.empty(MARK, dtype=torch.uint8, device="cuda")  # freed at once: the marker
        row = measure(step_args, plugins)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(None)
        fits.append({"fit": fit_name(step_args), **peaks(snapshot)})
        print(json.dumps({k: v for k, v in fits[-1].items() if not k.endswith("_at_peak")}), flush=True)
        return row

    trainer_step.measure = recorded
    trainer_step.main()
    with open(os.path.join(out, "memory_peak.json"), "w") as f:
        json.dump({"args": sys.argv[1:], "torch": torch.__version__, "fits": fits}, f, indent=1)


if __name__ == "__main__":
    main()
