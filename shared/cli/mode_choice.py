"""Which serving mode `pdserve up` runs when neither `--colocated` nor `--disaggregated` (nor `--prefill` /
`--decode`) is given: on one GPU the mode that measured the higher goodput for the default workload, read from a
packaged data file (`pdserve/data/mode_choice.json`, written by `bench/one_gpu.py` from its run); with two GPUs or
more prefill and decode on separate GPUs; without GPUs (CPU) today's default, prefill + decode.

The data file's `one_gpu` entry is `{"measured": false, "reason": ...}` until a run measured both modes; then
`{"measured": true, "colocated_goodput_rps", "disaggregated_goodput_rps", "colocated_ttft_ms_p50_2rps",
"disaggregated_ttft_ms_p50_2rps", "workload", "device", "date", "commit"}`. A `cpu` entry of the same form would
decide CPU stacks; none is shipped.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_FILE = Path(__file__).resolve().parent.parent / "data" / "mode_choice.json"  # the pdserve.data package
SCHEMA = "pdserve.mode_choice/1"
MAX_DATA_BYTES = 64 << 10  # the file is a few hundred bytes; anything larger is not ours
COLOCATED, DISAGGREGATED = "colocated", "disaggregated"
DEFAULT_MODE = DISAGGREGATED  # what `pdserve up` ran before any measurement


@dataclass(frozen=True)
class ModeChoice:
    mode: str  # colocated | disaggregated
    reason: str  # the figures (or the rule) behind it, one clause

    @property
    def colocated(self) -> bool:
        return self.mode == COLOCATED

    def line(self) -> str:
        """The one line `pdserve up` prints."""
        what = "engines that prefill and decode" if self.colocated else "prefill + decode engines"
        return f"pdserve up: mode {self.mode} ({what}): {self.reason}"


def load_measurements(path: Path | None = None) -> dict[str, Any]:
    """The data file's object (`path`, default DATA_FILE); {} when it is missing, too large or not ours (the rule
    then keeps the default)."""
    path = DATA_FILE if path is None else path
    try:
        if path.stat().st_size > MAX_DATA_BYTES:
            return {}
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) and doc.get("schema") == SCHEMA else {}


def _figure(entry: dict[str, Any], key: str) -> float | None:
    v = entry.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def choose_from_measurement(entry: dict[str, Any] | None, where: str) -> ModeChoice:
    """The mode of one placement's entry (`where`: words for the placement): the higher measured goodput; on a tie
    the lower median TTFT at 2 req/s; without both goodputs the default, saying why."""
    if not entry or not entry.get("measured"):
        why = (entry or {}).get("reason") or "no entry"
        return ModeChoice(DEFAULT_MODE, f"{where}: no measurement ({why}); the default")
    coloc, disagg = _figure(entry, "colocated_goodput_rps"), _figure(entry, "disaggregated_goodput_rps")
    if coloc is None or disagg is None:
        return ModeChoice(DEFAULT_MODE, f"{where}: the measurement lacks a goodput of each mode; the default")
    source = ", ".join(str(entry[k]) for k in ("device", "workload", "commit", "date") if entry.get(k))
    figures = f"goodput {coloc:g} req/s colocated vs {disagg:g} disaggregated"
    if coloc != disagg:
        mode = COLOCATED if coloc > disagg else DISAGGREGATED
        return ModeChoice(mode, f"{where}: measured {figures} ({source})")
    t_coloc = _figure(entry, "colocated_ttft_ms_p50_2rps")
    t_disagg = _figure(entry, "disaggregated_ttft_ms_p50_2rps")
    if t_coloc is None or t_disagg is None or t_coloc == t_disagg:
        return ModeChoice(DEFAULT_MODE, f"{where}: measured {figures}, a tie; the default ({source})")
    mode = COLOCATED if t_coloc < t_disagg else DISAGGREGATED
    ttfts = f"TTFT p50 at 2 req/s {t_coloc:.0f} ms colocated vs {t_disagg:.0f} ms disaggregated"
    return ModeChoice(mode, f"{where}: measured {figures}, a tie; {ttfts} ({source})")


def choose_mode(gpus: list[int], data: dict[str, Any], prefill_tp: int = 1, decode_tp: int = 1) -> ModeChoice:
    """The mode when no flag forces one, for the GPUs the engines get (`--gpus`: [] = CPU / each engine's own
    device) and the data file's object (`load_measurements`). Tensor parallel: a prefill and a decode instance
    need `prefill_tp` + `decode_tp` GPUs to run apart; fewer (one instance's group) is decided as one GPU is."""
    if len(gpus) >= max(2, prefill_tp + decode_tp):
        tp = f" ({prefill_tp} + {decode_tp} per pair, tensor parallel)" if max(prefill_tp, decode_tp) > 1 else ""
        return ModeChoice(DISAGGREGATED, f"{len(gpus)} GPUs: prefill and decode on separate GPUs{tp}")
    if len(gpus) > 1:  # one tensor-parallel group: prefill and decode instances would share its GPUs
        where = f"one tensor-parallel group (cuda:{','.join(map(str, gpus))}), as on one GPU"
        return choose_from_measurement(data.get("one_gpu"), where)
    if len(gpus) == 1:
        return choose_from_measurement(data.get("one_gpu"), f"one GPU (cuda:{gpus[0]})")
    return choose_from_measurement(data.get("cpu"), "no GPU placement")


def forced_mode(colocated: int, disaggregated: bool) -> ModeChoice:
    """The mode a flag forced (`--colocated N` or `--disaggregated`, `--prefill` / `--decode` included)."""
    if colocated:
        return ModeChoice(COLOCATED, f"--colocated {colocated}")
    return ModeChoice(DISAGGREGATED, "--disaggregated" if disaggregated else "--prefill / --decode given")
