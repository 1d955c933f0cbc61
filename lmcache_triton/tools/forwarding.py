"""What both proxies share (`lmcache-triton proxy`, prefill/decode and KV-aware): an aiohttp app
with OpenAI's completion routes, /v1/models, /health, and a request forwarded to one upstream with
its answer streamed back unchanged (status, headers but the hop-by-hop ones, body)."""

from __future__ import annotations

import logging

logger = logging.getLogger("lmcache_triton.proxy")

COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
# Headers that describe one HTTP hop, not the content: never forwarded either way.
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


def error(status: int, message: str):
    from aiohttp import web

    return web.json_response({"error": {"message": message}}, status=status)


class Forwarder:
    """Subclasses answer `completion(request)`; `models_url()` names where /v1/models goes."""

    def __init__(self, *, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self.session = None

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        for path in COMPLETIONS:
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
    def headers(headers) -> dict[str, str]:
        return {k: v for k, v in headers.items() if k.lower() not in _HOP}

    async def health(self, request):
        from aiohttp import web

        return web.json_response({"status": "ok"})

    def models_url(self) -> str:
        raise NotImplementedError

    async def models(self, request):
        from aiohttp import web

        async with self.session.get(self.models_url() + "/v1/models", headers=self.headers(request.headers)) as r:
            return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)

    async def completion(self, request):
        raise NotImplementedError

    @staticmethod
    async def json_body(request) -> tuple[dict | None, object]:
        """(the request's JSON object, None), or (None, the 400 response to send)."""
        try:
            body = await request.json()
        except ValueError:
            return None, error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return None, error(400, "the request body must be a JSON object")
        return body, None

    async def open_upstream(self, url: str, request, body: dict):
        """POSTs the request to `url` + its path; the response, not yet read. Raises aiohttp's
        ClientError (ClientConnectorError: nobody listens there) or TimeoutError."""
        return await self.session.post(url + request.path, json=body, headers=self.headers(request.headers))

    async def stream_back(self, request, upstream):
        """The upstream's answer, status and body, streamed to the client as it comes."""
        from aiohttp import web

        async with upstream:
            response = web.StreamResponse(status=upstream.status, headers=self.headers(upstream.headers))
            await response.prepare(request)
            async for data in upstream.content.iter_any():
                await response.write(data)
            await response.write_eof()
            return response
