"""The `pdserve` command line: `main.py` parses and dispatches, `launch.py` starts services as processes."""

from pdserve.cli.main import main

__all__ = ["main"]
