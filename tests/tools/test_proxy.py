"""`lmcache-triton proxy`'s two modes from its command line: KV-aware routing (--backend,
--kv-events) and prefill/decode (--prefiller, --decoder, --decoder-pd); mixed or incomplete
arguments are a clear error naming what is wrong."""

from __future__ import annotations

import argparse

import pytest

from lmcache_triton.tools.kv_proxy import KVProxy
from lmcache_triton.tools.proxy import Proxy, add_proxy_parser, build_proxy


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_proxy_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["proxy", *argv])


def test_backends_and_event_streams_make_the_kv_aware_proxy():
    proxy = build_proxy(parse("--backend", "http://a:1/", "--kv-events", "tcp://a:5557",
                              "--backend", "http://b:1", "--kv-events", "tcp://b:5557,tcp://b:5558"))
    assert isinstance(proxy, KVProxy) and proxy.backends == ["http://a:1", "http://b:1"]
    assert [[s.endpoint for s in subs] for subs in proxy.subscribers] == [["tcp://a:5557"],
                                                                          ["tcp://b:5557", "tcp://b:5558"]]


def test_prefillers_and_decoders_make_the_pd_proxy():
    proxy = build_proxy(parse("--prefiller", "http://p:1", "--decoder", "http://d:1", "--decoder-pd", "d:7300"))
    assert isinstance(proxy, Proxy)


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--backend", "http://a:1"], "one --kv-events per --backend", id="no-events"),
    pytest.param(["--backend", "http://a:1", "--kv-events", "a:5557"], "must be a ZMQ endpoint", id="not-zmq"),
    pytest.param(["--kv-events", "tcp://a:1"], "needs its --backend", id="events-alone"),
    pytest.param(["--backend", "http://a:1", "--kv-events", "tcp://a:1", "--decoder", "http://d:1"], "not both",
                 id="mixed"),
    pytest.param([], "give --backend and --kv-events", id="nothing"),
    pytest.param(["--prefiller", "http://p:1", "--decoder", "http://d:1"], "give --backend and --kv-events",
                 id="pd-without-listener"),
    pytest.param(["--prefiller", "http://p:1", "--decoder", "http://d:1", "--decoder-pd", "d"], "HOST:PORT",
                 id="bad-listener"),
])
def test_wrong_arguments_are_a_clear_error(argv, message):
    with pytest.raises(ValueError, match=message):
        build_proxy(parse(*argv))
