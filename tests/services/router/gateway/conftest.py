"""Makes gateway_testutil importable from the gateway tests (pytest runs with --import-mode=importlib)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
