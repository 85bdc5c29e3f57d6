"""Makes the bench scripts importable as they import each other (a script's own folder is on its sys.path)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
