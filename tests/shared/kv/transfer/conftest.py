import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # connector_testutil (pytest runs with --import-mode=importlib)
