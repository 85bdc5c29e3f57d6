"""The prefill servicer's `_busy` (what its prompt-cache write-behind waits out): a request counts from its RPC's start,
its prefix lookup included, not only once the engine has it; the count goes back however the RPC's way there ends."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from pdserve.prefill.servicer import PrefillServicer
from pdserve.v1 import internal_pb2


class Stop(Exception):
    pass


def shell(head_start: bool = True) -> PrefillServicer:
    """A servicer with only what `_busy`, `Start` and the start of `Prefill` touch; its engine idle."""
    svc = PrefillServicer.__new__(PrefillServicer)
    svc._lock = threading.Lock()
    svc._active = svc._arriving = 0
    svc.loop = SimpleNamespace(engine=SimpleNamespace(has_unfinished_requests=lambda: False))
    svc.cfg = SimpleNamespace(head_start=head_start)
    svc.head_starts = SimpleNamespace(shape=object())
    svc.telemetry = SimpleNamespace(request=lambda name, context: None)
    return svc


def test_idle_until_a_request_arrives():
    svc = shell()
    assert not svc._busy()
    with svc._arrival():
        assert svc._busy()
        with svc._arrival():
            assert svc._busy()
        assert svc._busy()
    assert not svc._busy()


def test_a_head_start_is_busy_during_its_lookup():
    svc, seen = shell(), []

    def start(request, context, shape, t0):
        seen.append(svc._busy())  # the lookup and the engine admission run here
        return internal_pb2.PrefillStarted(started=True)

    svc._start = start
    got = svc.Start(internal_pb2.PrefillStart(request_id="r", start_key=b"k" * 16), context=None)
    assert got.started and seen == [True]
    assert not svc._busy()


def test_a_head_start_that_fails_gives_its_count_back():
    svc = shell()

    def start(request, context, shape, t0):
        raise Stop

    svc._start = start
    with pytest.raises(Stop):
        svc.Start(internal_pb2.PrefillStart(request_id="r", start_key=b"k" * 16), context=None)
    assert svc._arriving == 0 and not svc._busy()


def test_a_stream_is_busy_on_its_way_to_the_engine_and_gives_the_count_back_if_refused():
    svc, seen = shell(), []

    def arrive(request_iterator, context, scope, t0):
        seen.append(svc._busy())  # the request read, its transfer opened, its lookup, its admission
        raise Stop  # e.g. context.abort: a bad peer, an engine refusal

    svc._arrive = arrive
    with pytest.raises(Stop):
        next(svc.Prefill(iter(()), context=None))
    assert seen == [True]
    assert svc._arriving == 0 and not svc._busy()
