import argparse
import dataclasses

import pytest

from pdserve.config import Setting, add_dataclass_args, config_from, nested, opt, settings
from pdserve.decode.colocated_config import ColocatedConfig
from pdserve.decode.config import DecodeConfig
from pdserve.engine.config import EngineConfig
from pdserve.prefill.config import PrefillConfig
from pdserve.router.config import RouterConfig

ENGINE_SERVICES = (PrefillConfig, DecodeConfig, ColocatedConfig)


def parse(cls, argv, env):
    p = argparse.ArgumentParser()
    add_dataclass_args(p, cls)
    return config_from(cls, p.parse_args(argv), "PDSERVE_X_", environ=env)


def test_cli_overrides_env_overrides_default():
    cfg = parse(
        DecodeConfig, ["--model", "m", "--page-size", "8"], {"PDSERVE_X_PAGE_SIZE": "4", "PDSERVE_X_KV_DTYPE": "auto"}
    )
    assert (cfg.engine.page_size, cfg.engine.kv_dtype, cfg.engine.chunk_size) == (8, "auto", 2048)


def test_lists_and_bools():
    cfg = parse(RouterConfig, ["--model", "m", "--prefill", "a:1", "--prefill", "b:2"], {"PDSERVE_X_DECODE": "c:3,d:4"})
    assert cfg.prefill == ["a:1", "b:2"] and cfg.decode == ["c:3", "d:4"]
    cfg = parse(DecodeConfig, ["--model", "m"], {"PDSERVE_X_KV_ASYMMETRIC": "true"})
    assert cfg.engine.kv_asymmetric is True
    cfg = parse(DecodeConfig, ["--model", "m", "--insecure", "--cuda-graphs", "false"], {})
    assert cfg.insecure is True and cfg.engine.cuda_graphs is False  # a boolean flag alone means true


def test_invalid_values_exit_with_reason():
    with pytest.raises(SystemExit, match="kv-dtype"):
        parse(DecodeConfig, ["--model", "m", "--kv-dtype", "fp4"], {})
    with pytest.raises(SystemExit, match="page_size"):
        parse(DecodeConfig, ["--model", "m", "--page-size", "x"], {})
    with pytest.raises(SystemExit, match="--model"):
        parse(DecodeConfig, [], {})
    with pytest.raises(SystemExit, match="^--chunk-size must be > 0"):  # the engine's own check, in flag terms
        parse(ColocatedConfig, ["--model", "m", "--chunk-size", "0"], {})


@pytest.mark.parametrize("cls", ENGINE_SERVICES)
def test_every_engine_field_is_a_setting_of_each_engine_service(cls):
    """The engine reads `cfg.engine` as filled: each EngineConfig field is a flag / env variable of the service
    under its own name (`--model` for model_dir), and a value given there is the value the engine gets."""
    table = {s.path: s for s in settings(cls)}
    for f in dataclasses.fields(EngineConfig):
        s = table[("engine", f.name)]
        assert s.name == ("model" if f.name == "model_dir" else f.name) and s.help, f.name
    cfg = parse(
        cls,
        ["--model", "m", "--pdl", "false", "--gemv-plan", "cublas", "--fa3-num-splits", "2", "--batch-invariant"],
        {"PDSERVE_X_DENSE_DECODE_KERNEL": "fa3", "PDSERVE_X_CUDA_GRAPH_MAX_CONTEXT": "4096"},
    )
    e = cfg.engine
    assert (e.model_dir, e.pdl, e.gemv_plan, e.fa3_num_splits, e.batch_invariant) == ("m", False, "cublas", 2, True)
    assert (e.dense_decode_kernel, e.cuda_graph_max_context) == ("fa3", 4096) and cfg.model == "m"


def test_kv_dtype_default_is_defined_once():
    """Every engine service, `pdserve up` through them, and the engine as a library default to int8 KV from one
    place: EngineConfig's field (no service restates it)."""
    from pdserve.cli.up import engine_settings, up_parser

    for cls in ENGINE_SERVICES:
        (s,) = [s for s in settings(cls) if s.name == "kv_dtype"]
        assert s.default == "int8" == parse(cls, ["--model", "m"], {}).engine.kv_dtype
    assert EngineConfig(model_dir="m").kv_dtype == "int8"
    import inspect

    from pdserve.server import service_config

    assert '"kv_dtype"' not in inspect.getsource(service_config)  # not restated for the services
    up = up_parser().parse_args([])
    assert all(getattr(up, s.name) is None for s in engine_settings() if s.name != "torch_threads")
    assert "gil_switch_interval_us" in {s.name for s in engine_settings()}  # `up` hands it to each instance


def test_service_defaults_and_help_override_the_engines():
    col = {s.name: s for s in settings(ColocatedConfig)}
    dec = {s.name: s for s in settings(DecodeConfig)}
    assert (col["chunk_size"].default, dec["chunk_size"].default) == (512, 2048)
    assert parse(ColocatedConfig, ["--model", "m"], {}).engine.chunk_size == 512
    assert col["chunk_size"].help != dec["chunk_size"].help
    pre = {s.name: s for s in settings(PrefillConfig)}
    assert "decode's layout decides" in pre["kv_dtype"].help


def test_nested_settings_must_not_collide():
    @dataclasses.dataclass
    class Inner:
        port: int = opt(1, "inner port")

    @dataclasses.dataclass
    class Outer:
        port: int = opt(2, "outer port")
        inner: Inner = nested(Inner)

    with pytest.raises(TypeError, match="port"):
        settings(Outer)

    @dataclasses.dataclass
    class Renamed:
        port: int = opt(2, "outer port")
        inner: Inner = nested(Inner, names={"port": "inner_port"}, defaults={"port": 7})

    assert [s.name for s in settings(Renamed)] == ["port", "inner_port"]
    assert config_from(Renamed, None, "P_", environ={"P_PORT": "3"}).inner.port == 7
    assert config_from(Renamed, None, "P_", environ={"P_INNER_PORT": "5"}).inner.port == 5
    assert isinstance(settings(Renamed)[1], Setting) and settings(Renamed)[1].env("P_") == "P_INNER_PORT"


def test_prefill_runs_full_precision_unless_batch_invariant():
    cfg = parse(PrefillConfig, ["--model", "m", "--kv-dtype", "fp8"], {})
    assert cfg.pool_config().kv_dtype == "auto" and cfg.ship_formats() == [("fp8", 64)]
    assert cfg.engine.kv_dtype == "fp8"  # the config itself is not changed
    cfg = parse(PrefillConfig, ["--model", "m", "--batch-invariant", "true"], {})
    assert cfg.pool_config().kv_dtype == "int8" and cfg.pool_config() is cfg.engine


@pytest.mark.parametrize("cls", ENGINE_SERVICES)
def test_gil_switch_interval_setting(cls):
    assert parse(cls, ["--model", "m"], {}).gil_switch_interval_us == 0.0  # CPython's own
    cfg = parse(cls, ["--model", "m"], {"PDSERVE_X_GIL_SWITCH_INTERVAL_US": "250"})
    assert cfg.gil_switch_interval_us == 250.0
    with pytest.raises(SystemExit, match=r"--gil-switch-interval-us must be in \[0, 1000000\], got -5"):
        parse(cls, ["--model", "m", "--gil-switch-interval-us", "-5"], {})


def test_decode_yield_settings():
    cfg = parse(DecodeConfig, ["--model", "m"], {"PDSERVE_X_GPU_SHARE_FILE": "/dev/shm/x"})
    assert (cfg.gpu_share_file, cfg.yield_tpot_ms, cfg.yield_cap_ms) == ("/dev/shm/x", 0.0, 60.0)  # off by default
    with pytest.raises(SystemExit, match=r"--yield-tpot-ms must be in \[0, 1000\]"):
        parse(DecodeConfig, ["--model", "m", "--yield-tpot-ms", "-1"], {})


def test_validation_errors_name_flags_not_plain_words():
    with pytest.raises(SystemExit) as e:
        parse(DecodeConfig, ["--model", "m", "--gemv-plan", '{"bogus": null}'], {})
    assert str(e.value).startswith("--gemv-plan: want default|cublas|triton ") and "'gate_up'" in str(e.value)


@pytest.mark.parametrize("cls", (PrefillConfig, DecodeConfig))
def test_kv_link_settings_are_checked_alike(cls):
    with pytest.raises(SystemExit, match="--kv-transport must be one of auto, grpc, cuda-ipc, grpc-shm, got 'nvlink'"):
        parse(cls, ["--model", "m", "--kv-transport", "nvlink"], {})
    with pytest.raises(SystemExit, match="--kv-copy-threads must be >= 0, got -1"):
        parse(cls, ["--model", "m", "--kv-copy-threads", "-1"], {})
    with pytest.raises(SystemExit, match="--kv-shipper must be one of auto, on, off, got 'yes'"):
        parse(cls, ["--model", "m", "--kv-shipper", "yes"], {})
    with pytest.raises(SystemExit, match="--kv-shipper-arena-mb must be > 0, got 0.0"):
        parse(cls, ["--model", "m", "--kv-shipper-arena-mb", "0"], {})
    assert parse(cls, ["--model", "m", "--kv-transport", "cuda-ipc"], {}).kv_transport == "cuda-ipc"
    assert parse(cls, ["--model", "m"], {}).kv_shipper == "auto"  # on with CUDA
    assert parse(cls, ["--model", "m"], {}).kv_shippers == 2
    for bad in ("0", "17"):
        with pytest.raises(SystemExit, match=f"--kv-shippers must be in 1..16, got {bad}"):
            parse(cls, ["--model", "m", "--kv-shippers", bad], {})
    assert parse(cls, ["--model", "m", "--kv-shippers", "16"], {}).kv_shippers == 16


@pytest.mark.parametrize("cls, prefix", [(PrefillConfig, "PDSERVE_PREFILL_"), (DecodeConfig, "PDSERVE_DECODE_")])
def test_kv_shippers_from_the_service_env(cls, prefix):
    p = argparse.ArgumentParser()
    add_dataclass_args(p, cls)
    cfg = config_from(cls, p.parse_args(["--model", "m"]), prefix, environ={f"{prefix}KV_SHIPPERS": "4"})
    assert cfg.kv_shippers == 4


def test_each_prefill_shipper_arena_holds_two_batches():
    base = ["--model", "m", "--kv-batch-mb", "8", "--kv-shipper-arena-mb", "64"]
    assert parse(PrefillConfig, [*base, "--kv-shippers", "4"], {}).kv_shippers == 4  # 16 MiB each: two batches
    with pytest.raises(SystemExit, match=r"each KV shipper's arena \(--kv-shipper-arena-mb / --kv-shippers = 64 / 5\)"):
        parse(PrefillConfig, [*base, "--kv-shippers", "5"], {})
    with pytest.raises(SystemExit, match="must hold two batches of --kv-batch-mb"):
        parse(PrefillConfig, ["--model", "m", "--kv-batch-mb", "8", "--kv-shipper-arena-mb", "15"], {})


def test_decode_shipper_ports_stay_in_range():
    assert parse(DecodeConfig, ["--model", "m", "--kv-shipper-port", "65534", "--kv-shippers", "2"], {})
    with pytest.raises(SystemExit, match="--kv-shipper-port 65535 with --kv-shippers 2"):
        parse(DecodeConfig, ["--model", "m", "--kv-shipper-port", "65535", "--kv-shippers", "2"], {})
    with pytest.raises(SystemExit, match="must lie in 1..65535"):
        parse(DecodeConfig, ["--model", "m", "--kv-shipper-port", "-1"], {})
