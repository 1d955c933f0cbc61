"""`lmcache-triton proxy`: the front of a prefill/decode deployment (integration/vllm/pd.py).

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

logger = logging.getLogger("lmcache_triton.proxy")

_COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
# Headers that describe one HTTP hop, not the content: never forwarded either way.
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


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


class Proxy:
    def __init__(self, prefillers: list[str], decoders: list[Decoder], *, timeout_s: float = 600.0) -> None:
        if not prefillers or not decoders:
            raise ValueError("the proxy needs at least one --prefiller and one --decoder")
        self.prefillers = itertools.cycle([u.rstrip("/") for u in prefillers])
        self.decoders = itertools.cycle(decoders)
        self.timeout_s = timeout_s
        self.session = None

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        for path in _COMPLETIONS:
            app.router.add_post(path, self.completion)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=10))

    async def _stop(self, app) -> None:
        if self.session is not None:
            await self.session.close()

    @staticmethod
    def _headers(headers) -> dict[str, str]:
        return {k: v for k, v in headers.items() if k.lower() not in _HOP}

    async def health(self, request):
        from aiohttp import web

        return web.json_response({"status": "ok"})

    async def models(self, request):
        from aiohttp import web

        decoder = next(self.decoders)
        async with self.session.get(decoder.url.rstrip("/") + "/v1/models",
                                    headers=self._headers(request.headers)) as r:
            return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)

    async def completion(self, request):
        import aiohttp
        from aiohttp import web

        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": {"message": "the request body is not JSON"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "the request body must be a JSON object"}}, status=400)
        headers = self._headers(request.headers)
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
            upstream = await self.session.post(decoder.url.rstrip("/") + request.path, json=body, headers=headers)
        except (aiohttp.ClientError, TimeoutError) as e:
            return web.json_response({"error": {"message": f"decoder {decoder.url} unreachable: {e}"}}, status=502)
        async with upstream:
            response = web.StreamResponse(status=upstream.status, headers=self._headers(upstream.headers))
            await response.prepare(request)
            async for data in upstream.content.iter_any():
                await response.write(data)
            await response.write_eof()
            return response


def add_proxy_parser(sub) -> None:
    p = sub.add_parser("proxy", help="the OpenAI-compatible front of a prefill/decode deployment")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--prefiller", action="append", required=True, metavar="URL",
                   help="a prefill instance's base URL (repeat for several)")
    p.add_argument("--decoder", action="append", required=True, metavar="URL",
                   help="a decode instance's base URL (repeat for several)")
    p.add_argument("--decoder-pd", action="append", required=True, metavar="HOST:PORT",
                   help="that decoder's PD listener: its pd_peer_host and pd_peer_init_port (one per --decoder)")
    p.add_argument("--timeout", type=float, default=600.0, help="the longest one upstream request may take, seconds")
    p.set_defaults(func=cmd_proxy)


def cmd_proxy(args: argparse.Namespace) -> int:
    from aiohttp import web

    if len(args.decoder) != len(args.decoder_pd):
        raise SystemExit(f"give one --decoder-pd per --decoder ({len(args.decoder)} decoders, "
                         f"{len(args.decoder_pd)} --decoder-pd)")
    try:
        decoders = [Decoder(url, *parse_pd_address(pd)) for url, pd in zip(args.decoder, args.decoder_pd)]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    proxy = Proxy(args.prefiller, decoders, timeout_s=args.timeout)
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None)
    return 0
