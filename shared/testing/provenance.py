"""Which code a benchmark figure was measured on."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def git_commit(override: str = "") -> str:
    """`override`, else $PDSERVE_COMMIT (a copied tree's .git may not be the one measured), else the checkout's
    short HEAD with "-dirty" when tracked files differ from it; "unknown" without git."""
    if override or os.environ.get("PDSERVE_COMMIT"):
        return override or os.environ["PDSERVE_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    except OSError:
        return "unknown"
    if sha.returncode != 0:
        return "unknown"
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
