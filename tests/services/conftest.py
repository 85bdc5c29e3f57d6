"""Makes services_testutil importable from every test under tests/services, and gives this test process a
stack-wide internal token: every service a test starts inherits it ($PDSERVE_INTERNAL_TOKEN), and the tests' own
internal channels (`pdserve.server.grpc_util.channel`) carry it, as the processes of one stack do."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pdserve.server.auth import new_token

sys.path.insert(0, str(Path(__file__).parent))  # services_testutil (pytest runs with --import-mode=importlib)
os.environ.setdefault("PDSERVE_INTERNAL_TOKEN", new_token())
