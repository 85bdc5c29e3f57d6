"""Models by Hugging Face Hub id, against a fake hub on loopback (`fake_hub.FakeHub`, HF_ENDPOINT pointed at it),
never the internet: `--model org/name` is fetched into the HF cache under HF_HOME with HF_TOKEN sent, found there
again offline, and served by `pdserve up` like the local directory it came from; offline with an empty cache and an
unknown repository fail with a reason naming the model. huggingface_hub reads its environment when imported, so
each resolution runs in a fresh process, as `pdserve up` / `pdserve serve` do."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pdserve
from pdserve.engine.loader import model_fingerprint
from pdserve.models.checkpoints import build_checkpoint
from pdserve.models.hub import ModelNotFound, is_hub_id, resolve_model
from pdserve.server.auth import new_token
from pdserve.testing.hf_reference import hf_greedy, load_hf_model
from pdserve.testing.up_process import read_banner, stop

sys.path.insert(0, str(Path(__file__).parent))
from fake_hub import FakeHub

REPO = "org/tiny"
TOKEN = "hf_pdserve_test_token"
PROMPT = [5, 17, 99, 23, 8, 250, 31, 77, 12]
N = 8
RESOLVE = "import sys; from pdserve.models.hub import model_dir_or_exit; print('DIR', model_dir_or_exit(sys.argv[1]))"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = build_checkpoint(tmp_path_factory.mktemp("hub") / "tiny", arch="llama", seed=4)
    (d / "pytorch_model.bin").write_bytes(b"\0" * 4096)  # a format the engine does not load: never downloaded
    return d


@pytest.fixture(scope="module")
def hub(model_dir):
    with FakeHub({REPO: model_dir}) as h:
        yield h


def hf_env(hub: FakeHub | None, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(home), HF_ENDPOINT=hub.url if hub else "http://127.0.0.1:9", HF_TOKEN=TOKEN, **extra)
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    return env


def resolve(value: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RESOLVE, value], env=env, capture_output=True, text=True, timeout=300)


def resolved_dir(res: subprocess.CompletedProcess) -> Path:
    assert res.returncode == 0, res.stdout + res.stderr
    return Path(re.search(r"^DIR (.+)$", res.stdout, re.M).group(1))


def test_hub_ids_and_local_directories(model_dir, tmp_path):
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_hub_id("org/name.v2")
    assert not any(is_hub_id(v) for v in ("name", "org/name/extra", "/abs/dir", "./org/name", "org/", "/name"))
    local = resolve_model(str(model_dir), say=lambda _: None)
    assert local.path == model_dir and local.name == "tiny"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="is not a model directory"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ModelNotFound, match="not a Hugging Face Hub id"):
        resolve_model(str(tmp_path / "missing"))


def test_fetches_into_hf_home_then_serves_offline_from_the_cache(hub, model_dir, tmp_path):
    home = tmp_path / "hf"
    hub.requests.clear()
    snapshot = resolved_dir(resolve(REPO, hf_env(hub, home)))
    assert snapshot == home / "hub" / "models--org--tiny" / "snapshots" / hub.sha[REPO]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors"):  # fmt: skip
        assert (snapshot / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert model_fingerprint(snapshot) == model_fingerprint(model_dir)  # the engine's identity of the weights
    assert "pytorch_model.bin" not in hub.downloads() and not (snapshot / "pytorch_model.bin").exists()
    assert sorted(hub.downloads()) == sorted(p.name for p in snapshot.iterdir())  # each file fetched once
    hub_calls = [h for _, path, h in hub.requests if f"/{REPO}/" in path]
    assert hub_calls and all(h.get("authorization") == f"Bearer {TOKEN}" for h in hub_calls)  # HF_TOKEN

    hub.requests.clear()
    again = resolve(REPO, hf_env(None, home, HF_HUB_OFFLINE="1"))  # the hub unreachable, offline mode
    assert resolved_dir(again) == snapshot and hub.requests == []


def test_offline_with_an_empty_cache_names_the_model_and_offline_mode(tmp_path):
    res = resolve(REPO, hf_env(None, tmp_path / "hf", HF_HUB_OFFLINE="1"))
    assert res.returncode != 0
    assert f"{REPO} is not in the Hugging Face cache" in res.stderr and "HF_HUB_OFFLINE" in res.stderr
    assert "Traceback" not in res.stderr


def test_unknown_repository_names_it(hub, tmp_path):
    res = resolve("org/missing", hf_env(hub, tmp_path / "hf"))
    assert res.returncode != 0 and "org/missing: no such model on" in res.stderr and hub.url in res.stderr
    assert "Traceback" not in res.stderr


def test_unreachable_hub_says_so(tmp_path):
    res = resolve(REPO, hf_env(None, tmp_path / "hf"))  # HF_ENDPOINT: a port where nothing listens
    assert res.returncode != 0 and f"{REPO}: http://127.0.0.1:9 is unreachable" in res.stderr


def test_serve_reports_an_unknown_hub_model_before_starting(hub, tmp_path):
    """`pdserve serve ROLE --model org/name` resolves the id first: an unknown one ends it with the reason."""
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "router", "--model", "org/missing", "--port", "0"]
    env = {**hf_env(hub, tmp_path / "hf"), "PDSERVE_INTERNAL_TOKEN": new_token()}  # the router's internal identity
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "error: org/missing: no such model on" in res.stderr, res.stderr[-2000:]


def test_pdserve_up_serves_a_hub_model(hub, model_dir, tmp_path):
    """`pdserve up --model org/name`: fetched from the (fake) hub, served under that name, answering as
    transformers does on the local directory it came from."""
    env = {**hf_env(hub, tmp_path / "hf"), "PDSERVE_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", REPO, "--port", "0", "--gateway-port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        banner = read_banner(proc, timeout_s=240)
        assert any(f"model {REPO}: fetching from {hub.url}" in line for line in banner.lines)
        assert banner.model_name == REPO  # the API names the model by its hub id
        with pdserve.Client(banner.router, timeout=120) as c:
            out = c.generate(token_ids=PROMPT, max_tokens=N, temperature=0, ignore_eos=True)
        assert out.token_ids == hf_greedy(load_hf_model(model_dir), PROMPT, N)
    finally:
        stop(proc, timeout_s=60)
