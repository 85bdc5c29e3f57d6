"""engine/attention.py's pure helpers (CPU): which launch config the Triton int8 decode kernel gets per pool."""

from __future__ import annotations

import pytest

from pdserve.engine.attention import int8_launch_config

# the shapes of int8_decode_attention's DEFAULT_CONFIG / TILE_LAUNCH (that module needs Triton, absent on CPU CI)
DEFAULT = dict(block_n=32, num_warps=1, num_stages=3, split_mult=5)
TILE = dict(block_n=128, num_warps=4, num_stages=3)


def test_plane_pools_keep_the_one_warp_default():
    assert int8_launch_config(DEFAULT, TILE, {}, 128, 2, False) == DEFAULT
    assert int8_launch_config(DEFAULT, TILE, {}, 256, 2, False) == DEFAULT
    got = int8_launch_config(DEFAULT, TILE, {"split_mult": 2}, 128, 2, False)
    assert got == {**DEFAULT, "split_mult": 2}


@pytest.mark.parametrize(
    ("head_dim", "groups", "asym", "overrides"),
    [
        (128, 2, True, {}),  # asymmetric: the tile kernel
        (128, 4, False, {}),  # group 32 at head_dim 128
        (128, 1, False, {}),  # one group per head
        (64, 2, False, {}),  # head_dim 64: the fold2 kernel
        (64, 2, False, {"num_stages": 2}),
    ],
)
def test_other_int8_pools_get_the_tile_launch(head_dim, groups, asym, overrides):
    got = int8_launch_config(DEFAULT, TILE, overrides, head_dim, groups, asym)
    assert got == {**DEFAULT, **TILE, **overrides}


def test_overrides_win_over_the_tile_launch():
    got = int8_launch_config(DEFAULT, TILE, {"num_warps": 8, "block_n": 64}, 128, 2, True)
    assert (got["num_warps"], got["block_n"], got["num_stages"]) == (8, 64, 3)


def test_the_shapes_above_are_the_kernel_modules():
    """Where Triton is installed: DEFAULT / TILE above are int8_decode_attention's (the GPU's launch configs)."""
    pytest.importorskip("triton")
    from pdserve.engine.kernels import int8_decode_attention as kd

    assert kd.DEFAULT_CONFIG == DEFAULT and kd.TILE_LAUNCH == TILE
    for head_dim, groups, asym in [(128, 2, False), (256, 2, False), (128, 2, True), (128, 4, False), (64, 2, False)]:
        planes = int8_launch_config(DEFAULT, TILE, {}, head_dim, groups, asym) == DEFAULT
        assert kd.reads_planes(head_dim, groups, asym) == planes  # the launch follows the kernel the shape picks
