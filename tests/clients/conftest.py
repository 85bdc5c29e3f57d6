"""The client contract tests' process-wide internal token (every service a test starts inherits it), as
tests/services/conftest.py gives its tests."""

from __future__ import annotations

import os

from pdserve.server.auth import new_token

os.environ.setdefault("PDSERVE_INTERNAL_TOKEN", new_token())
