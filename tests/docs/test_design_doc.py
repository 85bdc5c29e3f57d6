"""docs/design.md names modules that exist: every backticked source path (`shared/...py`, `services/...`,
`bench/...py`, or a path relative to a package such as `kernels/gemv.py`), every bare module file name
(`servicer.py`) and every dotted `pdserve.x.y` name (a module, or a name the module defines) must be found in the
tree. A page that names a deleted or renamed module fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "design.md"
SOURCE_DIRS = ("shared", "services", "bench", "scripts")  # where a path relative to a package may live
ROOTED = ("shared/", "services/", "bench/", "scripts/", "tests/", "protos/", "deploy/")
PACKAGES = {f"pdserve.{s}": f"services/{s}" for s in ("router", "prefill", "decode")}  # the rest: shared/

BACKTICKED = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^[A-Za-z0-9_./-]+$")
DOTTED = re.compile(r"\bpdserve(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def module_file(dotted: str, root: Path) -> tuple[Path | None, list[str]]:
    """The file or package directory of the longest module prefix of `dotted`, and the names after it."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        base = next((d for p, d in PACKAGES.items() if name == p or name.startswith(p + ".")), None)
        if base is not None:
            rel = Path(base, *name.split(".")[2:])
        else:
            rel = Path("shared", *parts[1:n])
        for cand in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
            if cand.is_file():
                return cand, parts[n:]
        if n == 1:  # `pdserve` itself
            return root / "shared" / "__init__.py", parts[1:]
    return None, parts


def problems(text: str, root: Path) -> tuple[list[str], int]:
    """(what the text names that the tree lacks, how many names were checked)."""
    missing: list[str] = []
    checked = 0
    names = {m.group(1).strip() for m in BACKTICKED.finditer(text)}
    dirs = [root / d for d in SOURCE_DIRS if (root / d).is_dir()]
    py_files = [p.relative_to(root).as_posix() for d in dirs for p in d.rglob("*.py")]
    for name in sorted(names):
        for dotted in DOTTED.findall(name):
            checked += 1
            path, rest = module_file(dotted, root)
            if path is None or len(rest) > 1:
                missing.append(f"module {dotted}")
            elif rest and not re.search(rf"\b{re.escape(rest[0])}\b", path.read_text()):
                missing.append(f"{dotted}: {rest[0]} is not in {path.relative_to(root)}")
        if not PATH.match(name) or "*" in name or name.startswith("pdserve"):
            continue
        if name.endswith(".py"):
            checked += 1
            if name.startswith(ROOTED):
                ok = (root / name).is_file()
            else:  # relative to some package (`kernels/gemv.py`) or a bare file name (`servicer.py`)
                ok = any(f == name or f.endswith("/" + name) for f in py_files)
            if not ok:
                missing.append(name)
        elif name.endswith("/") and name.startswith(ROOTED):
            checked += 1
            if not (root / name).is_dir():
                missing.append(name)
    return missing, checked


def test_every_module_the_design_names_exists():
    missing, checked = problems(DOC.read_text(), ROOT)
    assert checked >= 40, f"only {checked} module names found in docs/design.md: is the parser still reading it?"
    assert not missing, "docs/design.md names modules the tree does not have:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "line, bad",
    [
        ("the transport (`shared/kv/transfer/no_such_module.py`)", "shared/kv/transfer/no_such_module.py"),
        ("kernels (`kernels/no_such_kernel.py`)", "kernels/no_such_kernel.py"),
        ("the old name `pdserve.kv.codec.page_to_bytes`", "pdserve.kv.codec.page_to_bytes: page_to_bytes is not in"),
        ("a package `pdserve.nothing_here`", "pdserve.nothing_here"),
        ("a directory `shared/no_dir/`", "shared/no_dir/"),
        ("a nested package `pdserve.kv.no_such.module`", "module pdserve.kv.no_such.module"),
    ],
)
def test_a_missing_name_is_reported(line, bad):
    missing, checked = problems(line, ROOT)
    assert checked == 1 and len(missing) == 1 and missing[0].startswith(bad), missing


def test_names_that_exist_and_non_paths_pass():
    text = (
        "`shared/engine/engine.py` `kernels/gemv.py` `servicer.py` `pdserve.kv.transfer.for_prefill` "
        "`pdserve.router` `pdserve.server.status` `services/{router,prefill,decode}/` `*_pb2*.py` `--kv-dtype` "
        "`pdserve serve colocated` `docs/router.md` `add_request(EngineRequest)`"
    )
    missing, checked = problems(text, ROOT)
    assert not missing and checked == 6, (missing, checked)
