"""`build_engine`'s tensor-parallel check: prefill instances refuse `--tensor-parallel-size` > 1 (their pages would
hold rank 0's heads only), decode ones take it, a colocated one turns its prompt cache off; TP=1 changes nothing."""

from __future__ import annotations

import pytest

from pdserve.decode.colocated_config import ColocatedConfig
from pdserve.decode.config import DecodeConfig
from pdserve.prefill.config import PrefillConfig
from pdserve.server.runner import check_tensor_parallel


def test_prefill_refuses_tp_decode_takes_it():
    cfg = PrefillConfig()
    cfg.engine.tensor_parallel_size = 2
    with pytest.raises(SystemExit, match="--tensor-parallel-size 2: prefill instances run at 1"):
        check_tensor_parallel(cfg, cfg.engine)
    cfg.engine.tensor_parallel_size = 1
    check_tensor_parallel(cfg, cfg.engine)
    decode = DecodeConfig()
    decode.engine.tensor_parallel_size = 2
    check_tensor_parallel(decode, decode.engine)


def test_colocated_tp_turns_the_prompt_cache_off():
    cfg = ColocatedConfig()
    assert cfg.prompt_cache
    check_tensor_parallel(cfg, cfg.engine)
    assert cfg.prompt_cache  # TP=1: unchanged
    cfg.engine.tensor_parallel_size = 3
    check_tensor_parallel(cfg, cfg.engine)
    assert not cfg.prompt_cache
