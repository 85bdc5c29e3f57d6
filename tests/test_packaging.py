"""What `pip install .` (the container images' install, not editable) puts in the wheel: pyproject.toml lists the
packages by name, so a new package directory left off the list is missing from every image while editable installs
(make setup, CI) still import it. Every directory of Python modules under the package-dirs must be a listed package
with an __init__.py, and every listed package must exist."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
DIRS: dict[str, str] = SETUPTOOLS["package-dir"]


def folder_of(package: str) -> Path:
    """Where `package` lives: under its most specific package-dir mapping (`pdserve.router` -> services/router)."""
    base = max((k for k in DIRS if package == k or package.startswith(k + ".")), key=len)
    return ROOT / DIRS[base] / Path(*package.split(".")[len(base.split(".")) :])


def test_every_package_directory_is_in_the_wheel():
    listed = set(SETUPTOOLS["packages"])
    found: dict[str, Path] = {}
    for pkg, folder in DIRS.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            if "__pycache__" not in path.parts:
                name = ".".join([pkg, *path.parent.relative_to(base).parts])
                if folder_of(name) == path.parent:  # not a nested mapping's folder seen from its parent's
                    found[name] = path.parent
    missing = sorted(set(found) - listed)
    assert not missing, f"package directories not in pyproject.toml's [tool.setuptools] packages: {missing}"
    no_init = sorted(p for p, d in found.items() if not (d / "__init__.py").is_file())
    assert not no_init, f"package directories without an __init__.py: {no_init}"
    gone = sorted(p for p in listed if not folder_of(p).is_dir())
    assert not gone, f"listed packages with no directory: {gone}"
