"""`--model` as a local directory or a Hugging Face Hub id (`org/name`).

A value that names an existing path is a local model directory (it must hold config.json). Otherwise a value shaped
`org/name` is a hub id: `huggingface_hub.snapshot_download` fetches what the engine loads (top-level config,
tokenizer and chat-template files, then the safetensors weights: those the shard index names, else
`model.safetensors`, else every top-level `*.safetensors`) into the standard Hugging Face cache, with
huggingface_hub's own progress bars, and the snapshot directory is what every service loads. huggingface_hub reads
its settings from the environment when it is imported: `HF_HOME` / `HF_HUB_CACHE` (where), `HF_ENDPOINT` (which
hub, e.g. a mirror), `HF_TOKEN` (private or gated models), `HF_HUB_OFFLINE=1` (the cache only). A model already in
the cache is used without a download (offline too).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")  # org/name, as the Hub spells them
METADATA_FILES = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]  # config, tokenizer, chat template
WEIGHT_INDEX = "model.safetensors.index.json"
SUBFOLDERS = ["*/*"]  # the engine loads the repository's top level only


class ModelNotFound(Exception):
    """`--model` names no usable model: not a model directory, not on the hub, or not reachable (offline)."""


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # a local Hugging Face model directory
    name: str  # how the API names it: the hub id, or the directory's name


def is_hub_id(value: str) -> bool:
    """Whether `value` is shaped like a hub id (`org/name`) and names no existing path."""
    return HUB_ID.fullmatch(value) is not None and not Path(value).expanduser().exists()


def served_name(value: str) -> str:
    """How the API names the model `--model value` names (as ResolvedModel.name, without fetching anything)."""
    return value if is_hub_id(value) else Path(value).expanduser().resolve().name


def resolve_model(value: str, say: Callable[[str], None] = print) -> ResolvedModel:
    """The local directory `value` names, downloading a hub id first; raises ModelNotFound with the reason."""
    path = Path(value).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{value} is not a model directory (no config.json)")
        return ResolvedModel(path, path.resolve().name)
    if not is_hub_id(value):
        raise ModelNotFound(
            f"{value}: no such model directory, and not a Hugging Face Hub id (org/name, e.g. "
            "HuggingFaceTB/SmolLM2-135M-Instruct)"
        )
    return ResolvedModel(download(value, say), value)


def model_dir_or_exit(value: str) -> str:
    """`resolve_model(value).path` for a command line (progress lines on stdout); SystemExit with the reason when
    `value` names no usable model."""
    try:
        return str(resolve_model(value, say=lambda line: print(line, flush=True)).path)
    except ModelNotFound as e:
        raise SystemExit(f"error: {e}") from None


def download(repo_id: str, say: Callable[[str], None] = print) -> Path:
    """Fetch (or find in the cache) the files of hub model `repo_id` the engine loads; its snapshot directory."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if constants.HF_HUB_OFFLINE:
        say(f"model {repo_id}: HF_HUB_OFFLINE is set: looking in the Hugging Face cache {constants.HF_HUB_CACHE}")
    else:
        say(f"model {repo_id}: fetching from {constants.ENDPOINT} into {constants.HF_HUB_CACHE} (once: it is cached)")
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=METADATA_FILES, ignore_patterns=SUBFOLDERS))
        if not (folder / "config.json").is_file():
            raise ModelNotFound(f"{repo_id} on {constants.ENDPOINT} has no config.json: not a transformers model")
        for patterns in _weight_patterns(folder):
            folder = Path(snapshot_download(repo_id, allow_patterns=patterns, ignore_patterns=SUBFOLDERS))
            if any(folder.glob("*.safetensors")):
                break
    except GatedRepoError as e:
        raise ModelNotFound(
            f"{repo_id} is gated on {constants.ENDPOINT}: accept its terms there and set HF_TOKEN ({_first_line(e)})"
        ) from None
    except RepositoryNotFoundError as e:
        raise ModelNotFound(
            f"{repo_id}: no such model on {constants.ENDPOINT} (or it is private: set HF_TOKEN) ({_first_line(e)})"
        ) from None
    except RevisionNotFoundError as e:
        raise ModelNotFound(f"{repo_id}: revision not found on {constants.ENDPOINT} ({_first_line(e)})") from None
    except LocalEntryNotFoundError as e:
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFound(
                f"{repo_id} is not in the Hugging Face cache {constants.HF_HUB_CACHE} and HF_HUB_OFFLINE is set: "
                "fetch it once online (unset HF_HUB_OFFLINE), or pass a local model directory"
            ) from None
        raise ModelNotFound(
            f"{repo_id}: {constants.ENDPOINT} is unreachable and the model is not in the Hugging Face cache "
            f"{constants.HF_HUB_CACHE} ({_first_line(e)})"
        ) from None
    except HfHubHTTPError as e:
        raise ModelNotFound(f"{repo_id}: {constants.ENDPOINT} answered {_first_line(e)}") from None
    if not any(folder.glob("*.safetensors")):
        raise ModelNotFound(f"{repo_id} has no *.safetensors weights (pdserve loads safetensors checkpoints only)")
    say(f"model {repo_id}: {folder}")
    return folder


def _weight_patterns(folder: Path) -> list[list[str]]:
    """The weight files to fetch, in order of preference: the shards the index names, else `model.safetensors`,
    else every top-level `*.safetensors`."""
    index = folder / WEIGHT_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        if shards:
            return [shards]
    return [["model.safetensors"], ["*.safetensors"]]


def _first_line(e: Exception) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(e).__name__
