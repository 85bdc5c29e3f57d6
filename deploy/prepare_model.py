"""Container start step (compose `model` service, Kubernetes init container): make sure a model directory is
at `$PDSERVE_MODEL_DIR` (default /models/model) before the services that load it start.

A directory with a config.json there (a mounted model) is used as it is. An empty one (a fresh volume) gets the
demo model (`pdserve.models.demo.ensure_demo_model`: SmolLM2-135M-Instruct, or its fallback), built in the cache
dir and copied in file by file, config.json last, each file renamed into place: the directory is complete as
soon as config.json appears, so an interrupted copy is redone at the next start and never half-used. A
non-empty directory with neither config.json nor the marker of such a copy is an error: a mounted directory that
is not a model is never written into.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

DEFAULT_DIR = "/models/model"
MARKER = ".pdserve-demo"  # written before the first file: a directory with it is ours to (re)fill


def prepare(target: Path, build: Callable[[], Path], say: Callable[[str], None] = print) -> Path:
    """Leave a model at `target`; `build()` returns a built model directory to copy from when it is empty."""
    if (target / "config.json").exists():
        say(f"model present at {target}")
        return target
    marker = target / MARKER
    if target.exists() and any(target.iterdir()) and not marker.exists():
        raise SystemExit(f"{target} holds files but no config.json: not a model directory, not writing into it")
    target.mkdir(parents=True, exist_ok=True)
    marker.write_text("demo model copy in progress or done; delete the directory's contents to rebuild\n")
    source = build()
    files = sorted((p for p in source.iterdir() if p.is_file()), key=lambda p: (p.name == "config.json", p.name))
    for src in files:
        partial = target / f".partial-{src.name}"
        shutil.copyfile(src, partial)
        os.replace(partial, target / src.name)
    say(f"demo model copied from {source} to {target}")
    return target


def main() -> int:
    target = Path(os.environ.get("PDSERVE_MODEL_DIR", DEFAULT_DIR))

    def build() -> Path:
        from pdserve.models.demo import ensure_demo_model

        return ensure_demo_model(say=lambda line: print(line, flush=True))

    prepare(target, build, say=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
