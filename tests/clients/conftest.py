"""The client contract tests' process-wide internal token (every service a test starts inherits it), as
tests/services/conftest.py gives its tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pdserve.server.auth import new_token

sys.path.insert(0, str(Path(__file__).parent))  # pushback_proxy (pytest runs with --import-mode=importlib)
os.environ.setdefault("PDSERVE_INTERNAL_TOKEN", new_token())
