"""Makes services_testutil importable from every test under tests/services."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # services_testutil (pytest runs with --import-mode=importlib)
