"""The docs claim only what exists: every spatial handler is listed in docs/ops.md, every test ops.md cites
exists and is parametrised on the layouts its row claims, README's test command is the one CI runs, and every
performance figure README quotes is the result row it cites."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_spatial.ops import FAMILIES, elementwise, queries

ROOT = Path(__file__).resolve().parents[1]
OPS = (ROOT / "docs" / "ops.md").read_text()
LAYOUT_CLAIM = re.compile(r"\b(w2|w3|h2|2x2|2|3)\b")  # "w2, w3, h2, 2x2"; "2, 3 ranks" for 1-d ops
TEST_REF = re.compile(r"`((?:[\w/]+/)?test_\w+\.py)(?:::(\w+))?`")


def _table() -> list[tuple[str, str, str]]:
    """(op, tested on, test) of every row of the coverage table."""
    rows = []
    for line in OPS.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 5 and cells[0] != "op" and not set(cells[0]) <= {"-"}:
            rows.append((cells[0], cells[3], cells[4]))
    return rows


def _resolve(name: str) -> Path:
    """``tests/ops/test_conv.py`` as written, or a bare ``test_conv.py`` as the one file of that name."""
    if "/" in name:
        return ROOT / name
    found = list((ROOT / "tests").rglob(name))
    assert len(found) == 1, f"docs/ops.md cites {name}: {len(found)} files have that name"
    return found[0]


@pytest.fixture(scope="module")
def node_ids() -> list[str]:
    files = sorted({str(_resolve(path).relative_to(ROOT)) for path, _ in TEST_REF.findall(OPS)})
    for f in files:
        assert (ROOT / f).exists(), f"docs/ops.md cites {f}, which does not exist"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_every_row_cites_tests_that_exist_on_the_layouts_it_claims(node_ids):
    for op, tested_on, test in _table():
        claims = set(LAYOUT_CLAIM.findall(tested_on))
        refs = TEST_REF.findall(test)
        assert refs or not claims, f"{op}: claims {tested_on!r} but cites no test"
        ids = []
        for path, function in refs:
            prefix = f"{_resolve(path).relative_to(ROOT)}::{function}"
            matching = [i for i in node_ids if i.startswith(prefix) and (not function or i[len(prefix)] in "[")]
            assert matching, f"{op}: docs/ops.md cites {path}{'::' + function if function else ''}, no such test"
            ids += matching
        params = {p for i in ids if "[" in i for p in i[i.index("[") + 1 : -1].split("-")}
        assert claims <= params, f"{op}: tested on {sorted(claims - params)} claimed, not in the cited tests' ids"


def _handler_names() -> set[str]:
    """Names of the torch functions the spatial families handle (element-wise and metadata tables aside)."""
    names = set()
    for family in FAMILIES:
        if family in (elementwise, queries):
            continue
        for func in family.HANDLERS:
            name = func.__self__.__name__ if type(func).__name__ == "method-wrapper" else func.__name__  # properties
            names.add(name.lstrip("_").removesuffix("_with_indices") if name != "__getitem__" else name)
    return names


def _documented_names() -> set[str]:
    """Names in backticks in docs/ops.md, shorthand expanded: ``F.dropout1d/2d/3d``, ``expand(_as)``."""
    names = set()
    for token in re.findall(r"`([^`]+)`", OPS):
        token = re.sub(r"^(F|nn|torch|x)\.", "", token)
        for part in re.split(r"[,\s]+", token):
            spread = re.fullmatch(r"(\w+?)(\d)d((?:/\dd)+)", part)
            optional = re.fullmatch(r"(\w+)\((_\w+)\)", part)
            if spread:
                names |= {f"{spread[1]}{d}d" for d in (spread[2], *re.findall(r"\d", spread[3]))}
            elif optional:
                names |= {optional[1], optional[1] + optional[2]}
            else:
                names.add(re.sub(r"\(.*", "", part))
    return names


# Handlers ops.md names in a group or by another spelling.
ALIASES = {
    "__getitem__": "x[...]",
    "setitem__": "__setitem__",
    "linalg_vector_norm": "linalg.vector_norm",
    "concat": "cat",
    "matmul__": "__matmul__",
    "rmatmul__": "__rmatmul__",
    **{f"grid_sampler_{d}d": "grid_sample" for d in (2, 3)},
    **{f"{kind}_pool{d}d": "pool 1d, 3d" for kind in ("max", "avg", "adaptive_max", "adaptive_avg") for d in (1, 3)},
}


def test_every_spatial_handler_is_in_docs_ops_md():
    documented = _documented_names()
    missing = sorted(
        name
        for name in _handler_names()
        if name not in documented and ALIASES.get(name, "\0") not in OPS + " ".join(documented)
    )
    assert not missing, f"handlers not listed in docs/ops.md: {missing}"


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if "-m pytest" in line and not line.startswith("#"))
    assert command in (ROOT / ".ci" / "run").read_text().splitlines(), command


# README's performance figures: each table row cites its result rows, and every number in it is recomputed from them.
README = (ROOT / "README.md").read_text()
RESULTS = ROOT / "benchmarks" / "results"
RESULT_NAME = re.compile(
    r"\d{4}-\d{2}-\d{2}_(h200|h100|2xh200|cpu)_[0-9a-f]{7,40}_[\w.+-]+\.(jsonl|json|json\.gz|csv|png|txt)"
)
CITATION = re.compile(r"\]\((benchmarks/results/[^)#\s]+)(?:#([^)\s]*))?\)")
BASELINES = {"shard": "shard alone", "one device": "one device"}


def _memory(row: dict, side: str) -> float:
    """A side's peak: the reserved memory where CUDA graphs hold their pool (as the benchmark compares), else
    the allocated."""
    graphed = row.get("graphs", "none") in ("ours", "both")
    return row[f"{side}_reserved_gib"] if graphed else row[f"{side}_gib"]


# Column title -> the value it shows, from the rows a table row cites (in citation order).
COLUMNS = {
    "S": lambda rows: rows[-1]["spatial"],
    "GiB per rank": lambda rows: _memory(rows[-1], "ours"),
    "baseline": lambda rows: BASELINES[rows[-1]["baseline"]],
    "baseline GiB": lambda rows: _memory(rows[-1], "shard"),
    "x baseline, time": lambda rows: rows[-1]["time_ratio"],
    "one GPU ms": lambda rows: rows[0]["shard_ms"],
    "one GPU GiB": lambda rows: rows[0]["shard_gib"],
    "two GPUs ms": lambda rows: rows[-1]["ours_ms"],
    "efficiency": lambda rows: rows[0]["shard_ms"] / (rows[-1]["spatial"] * rows[-1]["ours_ms"]),
}
# Phrases of a row's description -> what the cited row must say.
DESCRIBED = {
    r"\bfp32\b": lambda row: row["precision"] == "fp32",
    r"\bbf16\b": lambda row: row["precision"] == "bf16",
    r"\bConvNeXt-XL\b": lambda row: row["model"] == "convnext_xlarge",
    r"\bPETR\b": lambda row: row["model"] == "petr",
    r"\beager$": lambda row: row.get("compile", "none") == "none" and row.get("graphs", "none") == "none",
    r"\bcompiled\b": lambda row: row.get("compile", "none") != "none",
    r"\bCUDA graphs\b": lambda row: row.get("graphs", "none") != "none",
    r"\(both sides\)": lambda row: {row.get("compile", "none"), row.get("graphs", "none")} <= {"both", "none"},
    r"\beager shard alone\b": lambda row: "both" not in (row.get("compile", "none"), row.get("graphs", "none")),
    r"\bNCCL\b": lambda row: row["backend"] == "nccl",
    r"\bthrough the Trainer\b": lambda row: row.get("bench") == "trainer",
    r"\bon an H100\b": lambda row: "H100" in row["device"],
    # rows from before the ResNet BEV encoder have no "bev_encoder": the conv stack was the only one
    r"\bconv-stack BEV encoder\b": lambda row: row.get("bev_encoder", "convs") == "convs",
    r"\bResNet-\d+ BEV encoder\b": lambda row: row.get("bev_encoder", "convs").startswith("resnet"),
}


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def _tables(text: str) -> list[list[list[str]]]:
    """Markdown tables as lists of rows of cells (the separator row dropped)."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                current.append(cells)
        elif current:
            tables, current = tables + [current], []
    return tables


def _trainer_row(row: dict) -> dict:
    """A row of ``benchmarks/trainer_step.py`` in the terms of ``spatial_step.py``'s rows. Its memory columns are
    the reserved peaks (what it compares: graph pools included), and its graphs are the strategy's default ones;
    a BEV encoder it does not name is the model's default."""
    from lightning_spatial.models.bev import LiftSplat, SimpleBEV

    graphed = any(row["cuda_graphed"].values())
    detector = {"lift_splat": LiftSplat, "simple_bev": SimpleBEV}.get(row["model"])
    default = inspect.signature(detector).parameters["bev_encoder"].default if detector else None
    return {
        "bev_encoder": row.get("bev_encoder") or default,
        "bench": "trainer",
        "device": row["device"],
        "model": row["model"],
        "precision": {"bf16-mixed": "bf16", "32-true": "fp32"}.get(row["precision"], row["precision"]),
        "spatial": row["fake_world"] or row["world"],
        "baseline": {"device": "one device", "shard": "shard"}[row["baseline"]],
        "time_ratio": row["time_vs_baseline"],
        "ours_gib": row["reserved_gib"],
        "shard_gib": row["baseline_run"]["reserved_gib"],
        "compile": row["compile"] or "none",
        "graphs": "ours" if graphed else "none",
        "ours_reserved_gib": row["reserved_gib"],
        "shard_reserved_gib": row["baseline_run"]["reserved_gib"],
    }


def _cited(cell: str) -> list[dict]:
    """The result rows a cell links to: ``file.jsonl#L<line>`` or ``file.json#/rows/<index>`` (a JSON pointer)."""
    rows = []
    for path, fragment in CITATION.findall(cell):
        file = ROOT / path
        assert file.exists() and RESULT_NAME.fullmatch(file.name), f"README cites {path}: missing or misnamed"
        if file.suffix == ".jsonl":
            line = int(re.fullmatch(r"L(\d+)", fragment)[1])
            row = json.loads(file.read_text().splitlines()[line - 1])
            rows.append(_trainer_row(row) if "baseline_run" in row else row)
        else:
            node = json.loads(file.read_text())
            for key in fragment.strip("/").split("/"):
                node = node[int(key)] if isinstance(node, list) else node[key]
            rows.append(node)
    return rows


def _agrees(cell: str, value) -> bool:
    """The cell shows ``value`` as written: text as is, a number rounded to the cell's own decimals."""
    if isinstance(value, str):
        return cell == value
    written = re.fullmatch(r"\*{0,2}(\d+(?:\.(\d+))?)\*{0,2}", cell)
    return written is not None and f"{value:.{len(written[2] or '')}f}" == written[1]


def test_readme_performance_figures_are_the_result_rows_they_cite():
    tables = _tables(_section(README, "Performance"))
    assert tables, "README's performance section has no table"
    for header, *body in tables:
        *columns, source = header
        unknown = [c for c in columns[1:] if c not in COLUMNS]
        assert source in ("row", "rows") and not unknown, f"README table columns without a rule here: {unknown}"
        for cells in body:
            rows = _cited(cells[-1])
            assert rows, f"README performance row {cells[0]!r} cites no result row"
            for phrase, holds in DESCRIBED.items():
                assert not re.search(phrase, cells[0]) or holds(rows[-1]), f"{cells[0]!r}, {phrase!r}: {rows[-1]}"
            for title, cell in zip(columns[1:], cells[1:-1]):
                value = COLUMNS[title](rows)
                assert _agrees(cell, value), f"README {cells[0]!r}, {title!r}: {cell!r}, but its rows give {value}"


# A measured figure: a number with a unit of time, memory, speed or a ratio, or a detection score.
FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|s|GiB|MiB|GB|us|images/s)\b|\b\d+\.\d+x|\b\d+\.\d+%|\b(?:mAP|NDS) \d")


def test_readme_quotes_figures_only_in_its_checked_tables():
    prose = re.sub(r"```.*?```", "", README, flags=re.S)  # commands and their comments
    prose = "\n".join(line for line in prose.splitlines() if not line.startswith("|"))
    assert not FIGURE.findall(prose), f"README quotes figures outside its performance tables: {FIGURE.findall(prose)}"
    assert not re.search(r"\b\d+ tests\b", README), "README states a test count (it drifts; pytest prints it)"


def test_result_files_are_named_by_date_device_and_commit():
    misnamed = [p.name for p in RESULTS.iterdir() if not RESULT_NAME.fullmatch(p.name)]
    assert not misnamed, f"benchmarks/results/<date>_<h200|h100|2xh200|cpu>_<commit>_<what>.<ext>: {misnamed}"
