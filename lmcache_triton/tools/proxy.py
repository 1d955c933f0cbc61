"""`lmcache-triton proxy`: the front of a prefill/decode deployment (integration/vllm/pd.py), or,
with `--backend` and `--kv-events` instead, the KV-aware front of several instances (kv_proxy.py).

    lmcache-triton proxy --port 9000 --prefiller http://127.0.0.1:8100 \\
        --decoder http://127.0.0.1:8200 --decoder-pd 127.0.0.1:7300

OpenAI-compatible, as LMCache's and vLLM's disaggregation proxies: for each completion or chat
request it asks a prefiller for one token (max_tokens=1, not streamed) with
`kv_transfer_params.disagg_spec` naming the decoder's PD listener, then sends the client's request
unchanged to that decoder and streams its answer back. The prefiller's reply comes after its
transfer is done (the sender waits), so the decoder's lookup finds the prompt.

A prefiller that fails or is unreachable costs the transfer only: the decoder computes the prompt
itself. A decoder that fails is the client's error (its status and body). Prefillers and decoders
are taken in turn; `--decoder-pd` pairs with `--decoder` by position (one per decoder; the port is
rank 0's, rank r listens on port + r unless the decoder lists its ports: give them comma-separated).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import logging
import uuid
from dataclasses import dataclass

from lmcache_triton.tools.forwarding import Forwarder, error

logger = logging.getLogger("lmcache_triton.proxy")


@dataclass(frozen=True)
class Decoder:
    url: str
    pd_host: str
    pd_ports: tuple[int, ...]


def parse_pd_address(text: str) -> tuple[str, tuple[int, ...]]:
    """'host:port' or 'host:p0,p1,...' -> (host, ports)."""
    host, sep, ports = text.rpartition(":")
    try:
        values = tuple(int(p) for p in ports.split(","))
    except ValueError:
        values = ()
    if not sep or not host or not values or not all(0 < p < 65536 for p in values):
        raise ValueError(f"--decoder-pd must look like HOST:PORT or HOST:PORT,PORT,..., got {text!r}")
    return host.strip("[]"), values


def prefill_body(body: dict, decoder: Decoder, req_id: str) -> dict:
    """The prefiller's request: one token, not streamed, sending its KV to `decoder`."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    params = dict(out.get("kv_transfer_params") or {})
    params["disagg_spec"] = {"req_id": req_id, "receiver_host": decoder.pd_host,
                             "receiver_init_port": list(decoder.pd_ports)}
    out["kv_transfer_params"] = params
    return out


class Proxy(Forwarder):
    def __init__(self, prefillers: list[str], decoders: list[Decoder], *, timeout_s: float = 600.0) -> None:
        if not prefillers or not decoders:
            raise ValueError("the proxy needs at least one --prefiller and one --decoder")
        super().__init__(timeout_s=timeout_s)
        self.prefillers = itertools.cycle([u.rstrip("/") for u in prefillers])
        self.decoders = itertools.cycle(decoders)

    def models_url(self) -> str:
        return next(self.decoders).url.rstrip("/")

    async def completion(self, request):
        import aiohttp

        body, bad = await self.json_body(request)
        if body is None:
            return bad
        headers = self.headers(request.headers)
        decoder = next(self.decoders)
        prefiller = next(self.prefillers)
        req_id = f"pd-{uuid.uuid4().hex}"
        try:
            async with self.session.post(prefiller + request.path, json=prefill_body(body, decoder, req_id),
                                         headers=headers) as r:
                await r.read()
                if r.status != 200:
                    logger.warning("prefiller %s answered %d for %s: the decoder computes the prompt", prefiller,
                                   r.status, req_id)
        except (aiohttp.ClientError, TimeoutError) as e:
            logger.warning("prefiller %s failed for %s (%s): the decoder computes the prompt", prefiller, req_id, e)
        try:
            upstream = await self.open_upstream(decoder.url.rstrip("/"), request, body)
        except (aiohttp.ClientError, TimeoutError) as e:
            return error(502, f"decoder {decoder.url} unreachable: {e}")
        return await self.stream_back(request, upstream)


def add_proxy_parser(sub) -> None:
    p = sub.add_parser("proxy", help="the OpenAI-compatible front of several vLLM instances: KV-aware routing "
                                     "(--backend, --kv-events) or prefill/decode (--prefiller, --decoder)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--backend", action="append", metavar="URL",
                   help="KV-aware routing: a vLLM instance's base URL (repeat for several)")
    p.add_argument("--kv-events", action="append", metavar="ENDPOINT",
                   help="that backend's KV event stream (vLLM's --kv-events-config endpoint, e.g. "
                        "tcp://127.0.0.1:5557; one per --backend, by position; comma-separated for a "
                        "backend's data-parallel ranks)")
    p.add_argument("--prefiller", action="append", metavar="URL",
                   help="prefill/decode: a prefill instance's base URL (repeat for several)")
    p.add_argument("--decoder", action="append", metavar="URL",
                   help="prefill/decode: a decode instance's base URL (repeat for several)")
    p.add_argument("--decoder-pd", action="append", metavar="HOST:PORT",
                   help="that decoder's PD listener: its pd_peer_host and pd_peer_init_port (one per --decoder)")
    p.add_argument("--timeout", type=float, default=600.0, help="the longest one upstream request may take, seconds")
    p.set_defaults(func=cmd_proxy)


def build_proxy(args: argparse.Namespace) -> Forwarder:
    """The proxy the arguments ask for; ValueError naming what is missing or mixed."""
    kv, pd = bool(args.backend or args.kv_events), bool(args.prefiller or args.decoder or args.decoder_pd)
    if kv and pd:
        raise ValueError("give either --backend/--kv-events (KV-aware routing) or --prefiller/--decoder/--decoder-pd "
                         "(prefill/decode), not both")
    if kv:
        from lmcache_triton.tools.kv_proxy import KVProxy

        if not args.backend:
            raise ValueError("--kv-events needs its --backend (one --kv-events per --backend)")
        endpoints = [[e.strip() for e in text.split(",") if e.strip()] for text in args.kv_events or []]
        bad = [e for eps in endpoints for e in eps if not e.startswith(("tcp://", "ipc://"))]
        if bad or any(not eps for eps in endpoints):
            raise ValueError(f"--kv-events must be a ZMQ endpoint such as tcp://HOST:PORT, got {bad or args.kv_events}")
        return KVProxy(args.backend, endpoints, timeout_s=args.timeout)
    if not args.prefiller or not args.decoder or not args.decoder_pd:
        raise ValueError("give --backend and --kv-events (KV-aware routing), or --prefiller, --decoder and "
                         "--decoder-pd (prefill/decode)")
    if len(args.decoder) != len(args.decoder_pd):
        raise ValueError(f"give one --decoder-pd per --decoder ({len(args.decoder)} decoders, "
                         f"{len(args.decoder_pd)} --decoder-pd)")
    decoders = [Decoder(url, *parse_pd_address(pd)) for url, pd in zip(args.decoder, args.decoder_pd)]
    return Proxy(args.prefiller, decoders, timeout_s=args.timeout)


def cmd_proxy(args: argparse.Namespace) -> int:
    from aiohttp import web

    try:
        proxy = build_proxy(args)
    except ValueError as e:
        raise SystemExit(f"lmcache-triton proxy: {e}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None)
    return 0
