"""`lmcache-triton proxy --backend URL --kv-events tcp://HOST:PORT ...`: the KV-aware front of
several vLLM instances (no prefill/decode split).

    lmcache-triton proxy --port 9000 \\
        --backend http://127.0.0.1:8100 --kv-events tcp://127.0.0.1:5557 \\
        --backend http://127.0.0.1:8200 --kv-events tcp://127.0.0.1:5558

Each OpenAI completion or chat request goes to the backend that holds the longest prefix of its
prompt, in any tier that publishes vLLM KV events (vLLM's own prefix cache: start each backend
with `--enable-prefix-caching` and `--kv-events-config`; offloaded tiers that publish their own),
as learned from each backend's event stream (`--kv-events`, one per `--backend` by position;
kv_events.py, kv_router.py). Equal prefixes: the backend with fewer requests in flight through
this proxy. Nothing cached anywhere: round-robin.

The prompt's tokens come from vLLM itself: the proxy asks a backend's POST /tokenize (the
completion's prompt with its add_special_tokens; the chat's messages with the request's chat
template settings), so they are exactly the tokens vLLM will cache, chat template included, and
the proxy needs no tokenizer. A prompt given as token ids is used as is. While no backend has
reported a block, nothing is tokenized (round-robin needs no tokens). When /tokenize fails
everywhere, the request goes round-robin.

A backend nobody listens on (connection refused) is skipped for the next one; any other upstream
failure is the client's (its status and body). A backend whose event stream is silent or down
still serves requests: it is matched on nothing until its events come, so it is reached by
round-robin. GET /proxy/stats: routing decisions, per backend the requests, in-flight count and
indexed blocks, and per event stream what arrived.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

from lmcache_triton.tools.forwarding import Forwarder, error
from lmcache_triton.tools.kv_events import EventSubscriber
from lmcache_triton.tools.kv_router import BackendIndex, KVRouter

logger = logging.getLogger("lmcache_triton.proxy")

TOKENIZE_TIMEOUT_S = 10.0
# The chat request's fields that change its tokens (vLLM's TokenizeChatRequest takes them too).
_CHAT_TOKENIZE_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                         "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")


def prompt_tokens(body: dict) -> list[int] | None:
    """A completion's prompt when given as token ids (or a batch of them: its first), else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


def tokenize_body(path: str, body: dict) -> dict | None:
    """The /tokenize request that gives the tokens vLLM will cache for this request; None when the
    request has nothing to tokenize (no text prompt, no messages)."""
    out = {"model": body["model"]} if "model" in body else {}
    if path.endswith("/chat/completions"):
        if not isinstance(body.get("messages"), list):
            return None
        return out | {k: body[k] for k in _CHAT_TOKENIZE_FIELDS if k in body}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch: routed by its first prompt
    if not isinstance(prompt, str):
        return None
    return out | {"prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}


class KVProxy(Forwarder):
    def __init__(self, backends: list[str], kv_events: list[list[str]], *, timeout_s: float = 600.0) -> None:
        if not backends:
            raise ValueError("the proxy needs at least one --backend")
        if len(kv_events) != len(backends):
            raise ValueError(f"give one --kv-events per --backend ({len(backends)} backends, "
                             f"{len(kv_events)} --kv-events)")
        super().__init__(timeout_s=timeout_s)
        self.backends = [u.rstrip("/") for u in backends]
        self.indexes = [BackendIndex() for _ in backends]
        self.router = KVRouter(self.indexes)
        self.subscribers = [[EventSubscriber(ep, ix.apply) for ep in endpoints]
                            for ix, endpoints in zip(self.indexes, kv_events)]
        self.tokenize_failures = 0
        self._tokenize_next = 0

    def app(self):
        app = super().app()
        app.router.add_get("/proxy/stats", self.stats)
        return app

    async def _start(self, app) -> None:
        await super()._start(app)
        for subs in self.subscribers:
            for s in subs:
                s.start()

    async def _stop(self, app) -> None:
        for subs in self.subscribers:
            for s in subs:
                s.close()
        await super()._stop(app)

    def models_url(self) -> str:
        return self.backends[0]

    async def tokens(self, path: str, body: dict) -> list[int] | None:
        """The prompt's token ids as vLLM makes them; None when no backend could say."""
        import aiohttp

        given = prompt_tokens(body)
        if given is not None:
            return given
        ask = tokenize_body(path, body)
        if ask is None:
            return None
        first, self._tokenize_next = self._tokenize_next, (self._tokenize_next + 1) % len(self.backends)
        for i in self.router.order_after(first):
            status = None
            try:
                async with self.session.post(self.backends[i] + "/tokenize", json=ask,
                                             timeout=aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S)) as r:
                    status = r.status
                    if status == 200:
                        tokens = (await r.json()).get("tokens")
                        if isinstance(tokens, list):
                            return tokens
                    why = f"status {status}: {(await r.text())[:200]}"
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                why = repr(e)
            logger.warning("could not tokenize a prompt at %s (%s)", self.backends[i], why)
            if status is not None and 400 <= status < 500:
                break  # the request itself is wrong: every backend would say so (and so will the answer)
        self.tokenize_failures += 1
        return None

    async def completion(self, request):
        import aiohttp

        body, bad = await self.json_body(request)
        if body is None:
            return bad
        # While no backend reported a block, every prompt goes round-robin: no need for its tokens.
        tokens = await self.tokens(request.path, body) if self.router.any_blocks() else None
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        decision = self.router.choose(tokens, salt)
        last = None
        for i in self.router.order_after(decision.backend):
            load = self.router.loads[i]
            load.in_flight += 1
            try:
                try:
                    upstream = await self.open_upstream(self.backends[i], request, body)
                except aiohttp.ClientConnectorError as e:  # nobody listens there: the next one
                    logger.warning("backend %s unreachable (%s): trying the next", self.backends[i], e)
                    last = e
                    continue
                except (aiohttp.ClientError, TimeoutError) as e:
                    return error(502, f"backend {self.backends[i]} failed: {e!r}")
                load.requests += 1
                return await self.stream_back(request, upstream)
            finally:
                load.in_flight -= 1
        return error(502, f"no backend reachable (the last: {last})")

    def stats_dict(self) -> dict:
        now = time.monotonic()
        backends = []
        for url, ix, load, subs in zip(self.backends, self.indexes, self.router.loads, self.subscribers):
            streams = []
            for s in subs:
                st = asdict(s.stats)
                at = st.pop("last_batch_at")
                streams.append({"endpoint": s.endpoint, **st,
                                "last_batch_s_ago": None if at is None else round(now - at, 3)})
            backends.append({"url": url, **asdict(load), "index": ix.summary(), "kv_events": streams})
        return {"decisions": {"kv_routed": self.router.kv_routed, "round_robin": self.router.round_robin},
                "tokenize_failures": self.tokenize_failures, "backends": backends}

    async def stats(self, request):
        from aiohttp import web

        return web.json_response(self.stats_dict())
