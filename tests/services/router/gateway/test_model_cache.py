"""The gateway's per-credential cache of the router's model list (model_cache.py): a burst of requests makes one
ListModels call per credential, entries expire after the TTL, the number of credentials kept is bounded, errors are
never kept; and through a gateway process in front of a scripted router that counts its ListModels calls."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from gateway_testutil import ScriptedRouter, running_gateway

from pdserve.router.gateway.config import GatewayConfig
from pdserve.router.gateway.model_cache import ModelListCache, credential_key
from pdserve.testing.generation_server import generation_server
from pdserve.v1 import generate_pb2


def _meta(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}"), ("traceparent", f"00-{token}")]


class FakeRouter:
    """ListModels as a coroutine: counts its calls per credential; `gate` holds every call until set."""

    def __init__(self, names: list[str] | None = None, error: Exception | None = None):
        self.calls: collections.Counter[str] = collections.Counter()
        self.names: list[str] | None = ["alpha", "beta"] if names is None else names
        self.error = error
        self.gate = asyncio.Event()
        self.gate.set()

    async def list_models(self, metadata) -> list[str] | None:
        self.calls[dict(metadata).get("authorization", "")] += 1
        await self.gate.wait()
        if self.error is not None:
            raise self.error
        return self.names


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_makes_one_call_per_credential():
    async def main():
        router = FakeRouter()
        cache = ModelListCache(router.list_models, ttl_s=2.0, max_entries=8)
        router.gate.clear()  # every request arrives while the first call is still running
        burst = [asyncio.create_task(cache.get(_meta("a" if i % 4 else "b"))) for i in range(20)]
        await asyncio.sleep(0)
        router.gate.set()
        results = await asyncio.gather(*burst)
        assert all(r == ["alpha", "beta"] for r in results)
        assert router.calls == {"Bearer a": 1, "Bearer b": 1}
        assert await cache.get(_meta("a")) == ["alpha", "beta"] and router.calls["Bearer a"] == 1  # kept
        results[0].append("mutated")  # a caller's list is its own copy
        assert await cache.get(_meta("a")) == ["alpha", "beta"]

    asyncio.run(main())


def test_entries_expire_after_the_ttl():
    async def main():
        router, clock = FakeRouter(), Clock()
        cache = ModelListCache(router.list_models, ttl_s=2.0, max_entries=8, clock=clock)
        await cache.get(_meta("a"))
        clock.now += 1.9
        await cache.get(_meta("a"))
        assert router.calls["Bearer a"] == 1
        clock.now += 0.2
        router.names = ["alpha", "beta", "gamma"]  # a model registered since
        assert await cache.get(_meta("a")) == ["alpha", "beta", "gamma"]
        assert router.calls["Bearer a"] == 2

    asyncio.run(main())


def test_the_number_of_credentials_kept_is_bounded():
    async def main():
        router = FakeRouter()
        cache = ModelListCache(router.list_models, ttl_s=60.0, max_entries=2)
        for token in ("a", "b", "a", "c"):  # "b" is then the least recently used
            await cache.get(_meta(token))
        assert len(cache) == 2
        await cache.get(_meta("a"))
        await cache.get(_meta("c"))
        assert router.calls == {"Bearer a": 1, "Bearer b": 1, "Bearer c": 1}
        await cache.get(_meta("b"))  # dropped: asked again
        assert router.calls["Bearer b"] == 2 and len(cache) == 2

    asyncio.run(main())


def test_errors_reach_every_waiter_and_are_not_kept():
    async def main():
        router = FakeRouter(error=RuntimeError("router down"))
        cache = ModelListCache(router.list_models, ttl_s=60.0, max_entries=8)
        router.gate.clear()
        burst = [asyncio.create_task(cache.get(_meta("a"))) for _ in range(5)]
        await asyncio.sleep(0)
        router.gate.set()
        results = await asyncio.gather(*burst, return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results) and router.calls["Bearer a"] == 1
        router.error = None
        assert await cache.get(_meta("a")) == ["alpha", "beta"]
        assert router.calls["Bearer a"] == 2 and len(cache) == 1

    asyncio.run(main())


def test_a_caller_that_goes_away_does_not_cancel_the_shared_call():
    async def main():
        router = FakeRouter()
        cache = ModelListCache(router.list_models, ttl_s=60.0, max_entries=8)
        router.gate.clear()
        leaver, stayer = (asyncio.create_task(cache.get(_meta("a"))) for _ in range(2))
        await asyncio.sleep(0)
        leaver.cancel()
        router.gate.set()
        assert await stayer == ["alpha", "beta"] and router.calls["Bearer a"] == 1

    asyncio.run(main())


def test_no_list_models_is_kept_and_ttl_zero_always_asks():
    async def main():
        router = FakeRouter()
        router.names = None  # a router without ListModels
        cache = ModelListCache(router.list_models, ttl_s=60.0, max_entries=8)
        assert await cache.get(_meta("a")) is None and await cache.get(_meta("a")) is None
        assert router.calls["Bearer a"] == 1
        uncached = ModelListCache(router.list_models, ttl_s=0, max_entries=8)
        for _ in range(3):
            await uncached.get(_meta("b"))
        assert router.calls["Bearer b"] == 3 and len(uncached) == 0

    asyncio.run(main())


def test_keys_and_limits():
    assert credential_key(_meta("a")) == credential_key([("authorization", "Bearer a")])  # trace headers ignored
    assert credential_key(_meta("a")) != credential_key(_meta("b")) != credential_key([])
    assert b"Bearer" not in credential_key(_meta("a"))  # a digest, not the token
    with pytest.raises(ValueError):
        ModelListCache(FakeRouter().list_models, ttl_s=-1, max_entries=8)
    with pytest.raises(ValueError):
        ModelListCache(FakeRouter().list_models, ttl_s=1, max_entries=0)
    for bad in (dict(models_cache_s=-0.5), dict(models_cache_size=0)):
        with pytest.raises(SystemExit, match="models-cache"):
            GatewayConfig(router="127.0.0.1:1", **bad).validate()  # type: ignore[arg-type]


class CountingRouter(ScriptedRouter):
    """A ScriptedRouter that serves ListModels (one model, "alpha") and counts the calls per credential."""

    def __init__(self):
        super().__init__()
        self.list_calls: collections.Counter[str] = collections.Counter()
        self.list_lock = threading.Lock()

    def ListModels(self, request, context):
        with self.list_lock:
            self.list_calls[dict(context.invocation_metadata()).get("authorization", "")] += 1
        return generate_pb2.ListModelsResponse(models=[generate_pb2.ModelInfo(name="alpha")])


N_REQUESTS = 24


def test_the_gateway_asks_once_per_credential_for_a_burst(tmp_path):
    servicer = CountingRouter()
    with generation_server(servicer) as router, running_gateway(router, tmp_path, "--models-cache-s", "1") as gw:
        base = f"http://{gw[0]}:{gw[1]}/v1"
        clients = {t: openai.OpenAI(base_url=base, api_key=t, max_retries=0, timeout=30) for t in ("tok-a", "tok-b")}

        def one(i: int) -> str:
            token = "tok-a" if i % 3 else "tok-b"
            model = "alpha" if i % 2 else "m"  # the served name, or the gateway's alias of the only model
            return clients[token].completions.create(model=model, prompt="ok", max_tokens=2).choices[0].text

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(N_REQUESTS))) == ["hello"] * N_REQUESTS
        assert servicer.list_calls == {"Bearer tok-a": 1, "Bearer tok-b": 1}
        assert len(servicer.metadata) == N_REQUESTS  # every completion reached the router
        with pytest.raises(openai.NotFoundError):  # an unknown model is still refused from the kept list
            clients["tok-a"].completions.create(model="gamma", prompt="ok")
        assert servicer.list_calls["Bearer tok-a"] == 1
        time.sleep(1.2)  # past the TTL: asked again
        clients["tok-a"].completions.create(model="alpha", prompt="ok")
        assert servicer.list_calls == {"Bearer tok-a": 2, "Bearer tok-b": 1}


def test_a_rejected_credential_is_asked_again(tmp_path):
    class Rejecting(CountingRouter):
        def ListModels(self, request, context):
            super().ListModels(request, context)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "unknown token")

    servicer = Rejecting()
    with generation_server(servicer) as router, running_gateway(router, tmp_path) as gw:
        client = openai.OpenAI(base_url=f"http://{gw[0]}:{gw[1]}/v1", api_key="bad", max_retries=0, timeout=30)
        for _ in range(3):
            with pytest.raises(openai.PermissionDeniedError):
                client.completions.create(model="m", prompt="ok")
        assert servicer.list_calls["Bearer bad"] == 3 and not servicer.metadata
