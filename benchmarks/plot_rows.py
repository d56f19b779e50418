"""Per-rank memory and step time against the spatial size: ours, the shard alone, and one device.

cd benchmarks/results && python ../plot_rows.py 2026-11-29_h200_6607383_convnext-xl-first-grid.jsonl \\
    2026-11-29_h200_687681a_convnext-xl.jsonl -o 2026-11-29_h200_687681a_convnext-xl-fp32.png
python benchmarks/plot_rows.py multirun/<date>/<time>/bench.csv             # a sweep.py CSV

Rows come from spatial_step.py JSONL or sweep.py CSV files; a later file's row replaces an earlier one of
the same configuration. One figure per run: the configuration with most rows unless ``--where`` picks one.
"One device" is the S=1 row (the whole image on one device); shard alone is the plain model on one rank's
share of the input (the ideal a spatial rank can reach); ours is that rank under the spatial strategy.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections import Counter
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback

CONFIG = ("model", "batch", "height", "width", "precision", "ckpt")


def load(paths: list[Path]) -> list[dict]:
    rows: dict[tuple, dict] = {}
    for path in paths:
        text = path.read_text()
        found = [json.loads(line) for line in text.splitlines()] if path.suffix == ".jsonl" else csv_rows(path)
        for row in found:
            row["ckpt"] = str(row["ckpt"]) in ("True", "true", "1")
            rows[tuple(row[k] for k in (*CONFIG, "spatial", "tiles"))] = row
    return list(rows.values())


def csv_rows(path: Path) -> list[dict]:
    def number(value: str):
        try:
            return int(value)
        except ValueError:
            try:
                return float(value)
            except ValueError:
                return value

    return [{k: number(v) for k, v in row.items()} for row in csv.DictReader(path.open())]


def plot(rows: list[dict], png: Path, where: dict[str, str] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if all(str(r[k]) == v for k, v in (where or {}).items())]
    config = Counter(tuple(r[k] for k in CONFIG) for r in rows).most_common(1)[0][0]
    rows = sorted((r for r in rows if tuple(r[k] for k in CONFIG) == config), key=lambda r: r["spatial"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    _panel(axes[0], rows, "step time", "ms", "ours_ms", "shard_ms")
    _panel(axes[1], rows, "peak memory per rank", "GiB", "ours_gib", "shard_gib")
    model, batch, height, width, precision, ckpt = config
    device = rows[-1].get("device", "")
    fig.suptitle(
        f"{model} {batch}x3x{height}x{width} {precision}{' + activation checkpointing' if ckpt else ''}, "
        f"one rank's step (forward, backward, AdamW) on {device}"
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _panel(ax, rows: list[dict], what: str, unit: str, ours: str, shard: str) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    if not any(math.isfinite(_value(r, ours)) for r in rows):
        ax.set_axis_off()
        ax.text(0.5, 0.5, f"{what}: not measured on {rows[-1].get('device', 'this device')}", ha="center")
        return
    split = [r for r in rows if r["spatial"] > 1]
    for tiles in sorted({_kind(r) for r in split}, reverse=True):
        mine = [r for r in split if _kind(r) == tiles]
        ax.plot([r["spatial"] for r in mine], [_value(r, ours) for r in mine], "o-", label=f"ours ({tiles})")
        for r in mine if tiles == "width" else ():
            ratio = _value(r, ours) / _value(r, shard)
            if math.isfinite(ratio):
                ax.annotate(f"{ratio:.3f}x", (r["spatial"], _value(r, ours)), textcoords="offset points", xytext=(6, 6))
    alone = {r["spatial"]: _value(r, shard) for r in split}
    ax.plot(
        list(alone), list(alone.values()), "s:", color="grey", label="shard alone (the ideal; ours' ratio annotated)"
    )
    one = [r for r in rows if r["spatial"] == 1]
    if one:
        whole = _value(one[-1], shard) if math.isfinite(_value(one[-1], shard)) else _value(one[-1], ours)
        ax.axhline(whole, color="black", ls="--", label=f"one device, whole image ({whole:.4g} {unit})")
    ax.set(xscale="log", yscale="log", xlabel="spatial ranks S", ylabel=unit, title=f"{what} ({unit})")
    ax.set_xticks([r["spatial"] for r in rows], [str(r["spatial"]) for r in rows])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.legend(fontsize=8, loc="lower left")


def _kind(row: dict) -> str:
    h, w = (int(n) for n in str(row["tiles"]).split("x"))
    return "width" if h == 1 else "height" if w == 1 else "2-D tiles"


def _value(row: dict, key: str) -> float:
    """Step times: the faster of the baseline's two runs (spatial_step.py times it before and after ours)."""
    if key == "shard_ms" and row.get("shard_ms_after") not in (None, ""):
        return min(row["shard_ms"], row["shard_ms_after"])
    value = row.get(key)
    return math.nan if value in (None, "") else float(value)  # no baseline run (baseline=0), or CPU memory


class PlotWhenSweepEnds(Callback):
    """Hydra callback (conf/bench.yaml): plot the sweep's CSV into bench.png beside it."""

    def on_multirun_end(self, config, **kwargs) -> None:
        HydraConfig.instance().set_config(config)  # csv is ${hydra:sweep.dir}/bench.csv
        path = Path(config.csv)
        if path.exists():
            print(f"plot: {plot(load([path]), path.with_suffix('.png'))}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rows", nargs="+", type=Path, help="spatial_step.py .jsonl or sweep.py .csv files")
    p.add_argument("-o", "--out", type=Path, default=Path("bench.png"))
    p.add_argument("--where", nargs="*", default=[], help="key=value filters, e.g. precision=bf16 layout=width")
    args = p.parse_args()
    print(plot(load(args.rows), args.out, dict(kv.split("=", 1) for kv in args.where)))


if __name__ == "__main__":
    main()
