"""Layer groups: a chunk's pages leave prefill a few layers at a time, as the forward computes them.

A batch carries whole pages or one layer range of them (`LayerRange`: layers [start, stop) of every page in the
batch). Prefill's `--kv-layer-group` L ships each computed chunk as groups [0, L), [L, 2L), ... (`layer_groups`),
each as soon as the forward wrote its last layer: the engine's per-layer hook gathers the group's rows and records a
CUDA event, and the sender copies them after the event on a side stream while the forward runs on. So even a prompt
of one chunk overlaps its transfer with its own compute. A page is complete on decode only when all its layers landed,
in order (`pages.ReceiverPages`). Decode says it accepts layer groups (`PrefillRequest.kv_layer_groups`); prefill
ships whole chunks to a decode that does not.

`LayerStream` is what a prefill request hands the engine (`EngineRequest.layer_stream`): the layout, the group size
and the sink that takes each group's `ExportedPages` on the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayerRange:
    """Layers [start, stop) of a page."""

    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start

    def is_all(self, num_layers: int) -> bool:
        return self.start == 0 and self.stop == num_layers


def layer_groups(num_layers: int, group: int) -> list[LayerRange]:
    """The ranges a chunk ships in: `group` layers each (the last may be shorter); one range of every layer when
    `group` is 0 or covers them all."""
    if group <= 0 or group >= num_layers:
        return [LayerRange(0, num_layers)]
    return [LayerRange(s, min(s + group, num_layers)) for s in range(0, num_layers, group)]


def effective_group(configured: int, num_layers: int, peer_accepts: bool) -> int:
    """Layers per shipment for one request: 0 (whole chunks) unless decode accepts groups and `configured` splits
    the model's layers into more than one group."""
    return configured if peer_accepts and 0 < configured < num_layers else 0


@dataclass
class LayerStream:
    """A prefill-only request whose computed pages leave layer group by layer group. `sink(exported)` runs on the
    engine thread during the forward, once per group of each chunk (an `ExportedPages` with `layers` set, its
    `ready` event recorded after the gather); `layout` is the format decode asked for."""

    layout: Any  # pdserve.kv.codec.KVLayoutSpec
    group: int  # layers per shipment (> 0, < layout.num_layers)
    sink: Callable[[Any], None]  # ExportedPages -> None

    def groups(self) -> list[LayerRange]:
        return layer_groups(self.layout.num_layers, self.group)

    def ending_at(self) -> dict[int, LayerRange]:
        """Last layer of each group -> the group (the hook exports a group once its last layer is written)."""
        return {r.stop - 1: r for r in self.groups()}
