"""Router limits and prompt-cache scopes (pdserve.router.limits): each limit's check, the scope of a tenant, and
the settings' own validation (through RouterConfig, as flags, environment and TOML fill it)."""

from __future__ import annotations

import argparse

import pytest

from pdserve.config import add_dataclass_args, config_from
from pdserve.engine.sampling import MAX_STOP_STRINGS
from pdserve.errors import InvalidRequest
from pdserve.router.config import ENV_PREFIX, RouterConfig
from pdserve.router.limits import RouterLimits
from pdserve.v1 import generate_pb2

LIMITS = RouterLimits(
    max_prompt_bytes=10, max_messages=2, max_stop=2, max_stop_chars=3, max_stop_token_ids=2, max_request_id_bytes=4
)


def req(**kw) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(**kw)


def msg(content: str, role: str = "user") -> generate_pb2.ChatMessage:
    return generate_pb2.ChatMessage(role=role, content=content)


@pytest.mark.parametrize(
    "request_, reason",
    [
        (req(prompt="x" * 11), "max_prompt_bytes=10"),
        (req(prompt="é" * 6), "max_prompt_bytes=10"),  # 6 characters, 12 bytes
        (req(messages=[msg("a")] * 3), "max_messages=2"),
        (req(messages=[msg("abc"), msg("abc")]), "max_prompt_bytes=10"),  # roles count: 2 × (4 + 3) bytes
        (req(prompt="a", sampling=generate_pb2.SamplingParams(stop=["a", "b", "c"])), "max_stop=2"),
        (req(prompt="a", sampling=generate_pb2.SamplingParams(stop=["abcd"])), "max_stop_chars=3"),
        (req(prompt="a", sampling=generate_pb2.SamplingParams(stop_token_ids=[1, 2, 3])), "max_stop_token_ids=2"),
        (req(prompt="a", request_id="abcde"), "max_request_id_bytes=4"),
        (req(prompt="a", request_id="éé£"), "max_request_id_bytes=4"),  # 3 characters, 6 bytes
    ],
)
def test_each_limit_refuses_with_its_name(request_, reason):
    with pytest.raises(InvalidRequest, match=reason):
        LIMITS.check_request(request_)


def test_at_the_limits_passes():
    LIMITS.check_request(req(prompt="x" * 10, request_id="abcd"))
    LIMITS.check_request(req(prompt="é" * 5))  # 10 bytes
    LIMITS.check_request(req(messages=[msg("a"), msg("b")]))
    LIMITS.check_request(req(prompt="a", sampling=generate_pb2.SamplingParams(stop=["abc", "d"], stop_token_ids=[1])))
    LIMITS.check_request(req(token_ids=generate_pb2.TokenIds(ids=[1] * 100)))  # the context bounds token ids


def test_cache_scope_per_tenant_unless_shared():
    limits = RouterLimits(cache_share=["alice=team", " bob = team "])
    assert limits.cache_scope("alice") == limits.cache_scope("bob") == "shared:team"
    assert limits.cache_scope("carol") == "tenant:carol"
    assert limits.cache_scope("team") == "tenant:team"  # a tenant named like a shared namespace is not in it
    assert RouterLimits().cache_scope("default") == "tenant:default"


def load(argv, env=None, tmp_path=None, toml: str = "") -> RouterConfig:
    p = argparse.ArgumentParser()
    add_dataclass_args(p, RouterConfig)
    if tmp_path is not None:
        (tmp_path / "r.toml").write_text(toml)
        argv = ["--config", str(tmp_path / "r.toml"), *argv]
    return config_from(RouterConfig, p.parse_args(["--model", "m", *argv]), ENV_PREFIX, environ=env or {})


def test_limits_from_flags_env_and_toml(tmp_path):
    cfg = load(
        ["--max-stop", "4", "--cache-share", "a=x", "--cache-share", "b=x"],
        {"PDSERVE_ROUTER_MAX_PROMPT_BYTES": "4096"},
        tmp_path,
        "[limits]\nmax_messages = 8\nmax_stop_chars = 99\n",
    )
    cfg.validate()
    assert (cfg.max_stop, cfg.max_prompt_bytes, cfg.max_messages, cfg.max_stop_chars) == (4, 4096, 8, 99)
    assert cfg.cache_scope("b") == "shared:x"


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--max-stop", str(MAX_STOP_STRINGS + 1)], "max_stop must be in"),
        (["--max-prompt-bytes", "0"], "max_prompt_bytes must be > 0"),
        (["--cache-share", "alice"], "TENANT=NAMESPACE"),
        (["--cache-share", "=team"], "TENANT=NAMESPACE"),
    ],
)
def test_bad_limit_settings_fail_validation(argv, problem):
    with pytest.raises(SystemExit, match=problem):
        load(argv).validate()
