"""Run a snippet in fresh interpreters under different PYTHONHASHSEEDs: for checks that a key or hash is the same
in every process (Python salts its str/bytes hash per process)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence


def outputs_under_hash_seeds(code: str, seeds: Sequence[str] = ("1", "2")) -> list[str]:
    """The stripped stdout of `python -c code`, once per PYTHONHASHSEED in `seeds` (a failing run raises)."""
    return [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in seeds
    ]
