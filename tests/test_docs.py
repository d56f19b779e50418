"""The docs claim only what exists: every spatial handler is listed in docs/ops.md, every test ops.md cites
exists and is parametrised on the layouts its row claims, and README's test command is the one CI runs."""

from __future__ import annotations

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
