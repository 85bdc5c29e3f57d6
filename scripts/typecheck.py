"""Type-check the `pdserve` package with mypy.

The distribution maps directories to one package (`shared/` → `pdserve`, `services/<name>/` → `pdserve.<name>`,
see pyproject.toml), which mypy cannot follow through the editable install's import hook. This builds the same
tree out of symlinks under build/typecheck/ and checks it as package `pdserve`. Usage: python scripts/typecheck.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def link_tree(dest: Path) -> Path:
    pkg = dest / "pdserve"
    if dest.exists():
        shutil.rmtree(dest)
    pkg.mkdir(parents=True)
    for entry in (ROOT / "shared").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for service in (ROOT / "services").iterdir():
        if (service / "__init__.py").exists():
            (pkg / service.name).symlink_to(service)
    return pkg


def main() -> int:
    link_tree(ROOT / "build" / "typecheck")
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "pdserve"]
    return subprocess.call(cmd, cwd=ROOT / "build" / "typecheck")


if __name__ == "__main__":
    sys.exit(main())
