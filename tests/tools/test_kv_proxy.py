"""The KV-aware proxy over HTTP, in-process: a real aiohttp proxy in front of two small upstream
servers that speak the part of vLLM's API the proxy uses (POST /tokenize, a streamed
/v1/completions naming who answered), its index fed with event batches as vLLM encodes them.
tests/e2e/test_kv_proxy_e2e.py runs the same against real vLLM servers."""

from __future__ import annotations

import asyncio
import json

import pytest

from lmcache_triton.tools.kv_events import decode_batch
from lmcache_triton.tools.kv_proxy import KVProxy, prompt_tokens, tokenize_body

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402


def test_token_id_prompts_need_no_tokenizer():
    assert prompt_tokens({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert prompt_tokens({"prompt": [[5, 6], [8]]}) == [5, 6]
    assert prompt_tokens({"prompt": "w5 w6"}) is None and prompt_tokens({"prompt": [True]}) is None


def test_the_tokenize_request_carries_what_changes_the_tokens():
    assert tokenize_body("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3}) == \
        {"model": "m", "prompt": "hi", "add_special_tokens": True}
    assert tokenize_body("/v1/completions", {"prompt": ["a", "b"], "add_special_tokens": False}) == \
        {"prompt": "a", "add_special_tokens": False}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": 1},
            "temperature": 0}
    assert tokenize_body("/v1/chat/completions", chat) == {k: v for k, v in chat.items() if k != "temperature"}
    assert tokenize_body("/v1/completions", {"prompt": None}) is None


class Upstream:
    """A stand-in backend: /tokenize reads words "w<id>", completions stream its name."""

    def __init__(self, name: str, tokenize_status: int = 200) -> None:
        self.name, self.tokenize_status = name, tokenize_status
        self.completions: list[dict] = []
        self.tokenized = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/completions", self.complete)
        return app

    async def tokenize(self, request):
        body = await request.json()
        self.tokenized += 1
        if self.tokenize_status != 200:
            return web.json_response({"error": "no"}, status=self.tokenize_status)
        return web.json_response({"tokens": [int(w[1:]) for w in body["prompt"].split()]})

    async def complete(self, request):
        self.completions.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for part in ("from ", self.name):
            await response.write(f"data: {json.dumps({'text': part})}\n\n".encode())
        await response.write_eof()
        return response


async def _serve(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def stored_batch(tokens: list[int], block_size: int = 4) -> list:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    n = len(tokens) // block_size
    event = kv_events.BlockStored(block_hashes=[1000 + i for i in range(n)], parent_block_hash=None,
                                  token_ids=tokens[:n * block_size], block_size=block_size, lora_id=None,
                                  medium="GPU", lora_name=None)
    return decode_batch(msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=0.0, events=[event])))


def run_proxy(upstreams: dict[int, Upstream], urls: list[str], free_port, scenario) -> dict:
    """Starts the upstreams and the proxy, runs `scenario(proxy, post)`, returns /proxy/stats."""

    async def main():
        runners = [await _serve(u.app(), port) for port, u in upstreams.items()]
        proxy = KVProxy(urls, [[f"tcp://127.0.0.1:{free_port()}"] for _ in urls])  # silent streams
        port = free_port()
        runners.append(await _serve(proxy.app(), port))
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as client:
                async def post(body: dict | bytes) -> tuple[int, str]:
                    sent = {"data": body} if isinstance(body, bytes) else {"json": body}
                    async with client.post(base + "/v1/completions", **sent) as r:
                        if r.status != 200:
                            return r.status, (await r.json())["error"]["message"]
                        return r.status, "".join(json.loads(line[6:])["text"] for line in (await r.text()).split("\n")
                                                 if line.startswith("data: "))
                await scenario(proxy, post)
                async with client.get(base + "/proxy/stats") as r:
                    return await r.json()
        finally:
            for runner in reversed(runners):
                await runner.cleanup()

    return asyncio.run(main())


def words(tokens: list[int]) -> str:
    return " ".join(f"w{t}" for t in tokens)


A, B = list(range(100, 112)), list(range(200, 212))


def test_a_cached_prompt_goes_where_its_blocks_are_and_the_rest_round_robin(free_port):
    ports = [free_port(), free_port()]
    ups = {p: Upstream(f"b{i}") for i, p in enumerate(ports)}
    answers = []

    async def scenario(proxy, post):
        answers.append(await post({"prompt": words(B)}))            # nothing cached: no /tokenize
        proxy.indexes[1].apply(stored_batch(A))
        for prompt in (words(A), A, words(B), words(B)):
            answers.append(await post({"prompt": prompt, "stream": True}))

    stats = run_proxy(ups, [f"http://127.0.0.1:{p}" for p in ports], free_port, scenario)
    assert answers == [(200, "from b0"), (200, "from b1"), (200, "from b1"), (200, "from b1"), (200, "from b0")]
    assert stats["decisions"] == {"kv_routed": 2, "round_robin": 3}
    assert [b["requests"] for b in stats["backends"]] == [2, 3]
    assert [b["kv_routed"] for b in stats["backends"]] == [0, 2]
    assert [b["in_flight"] for b in stats["backends"]] == [0, 0]
    assert stats["backends"][1]["index"]["blocks"] == 3
    assert sum(u.tokenized for u in ups.values()) == 3, "token-id prompts and the first, cold one: no /tokenize"
    assert ups[ports[1]].completions[1]["prompt"] == A, "the request is forwarded unchanged"


def test_a_backend_nobody_listens_on_is_skipped(free_port):
    up_port, dead = free_port(), free_port()
    ups = {up_port: Upstream("up")}
    answers = []

    async def scenario(proxy, post):
        for _ in range(2):
            answers.append(await post({"prompt": words(A)}))

    stats = run_proxy(ups, [f"http://127.0.0.1:{dead}", f"http://127.0.0.1:{up_port}"], free_port, scenario)
    assert answers == [(200, "from up")] * 2
    assert [b["requests"] for b in stats["backends"]] == [0, 2]


def test_a_prompt_that_cannot_be_tokenized_goes_round_robin(free_port):
    ports = [free_port(), free_port()]
    ups = {p: Upstream(f"b{i}", tokenize_status=500) for i, p in enumerate(ports)}
    answers = []

    async def scenario(proxy, post):
        proxy.indexes[1].apply(stored_batch(A))
        answers.append(await post({"prompt": words(A)}))

    stats = run_proxy(ups, [f"http://127.0.0.1:{p}" for p in ports], free_port, scenario)
    assert answers == [(200, "from b0")]
    assert stats["tokenize_failures"] == 1 and stats["decisions"]["round_robin"] == 1
    assert sum(u.tokenized for u in ups.values()) == 2, "every backend was asked once"


def test_a_body_that_is_not_json_is_a_400(free_port):
    answers = []

    async def scenario(proxy, post):
        answers.append(await post(b"{"))
        answers.append(await post(b"[1]"))

    run_proxy({}, ["http://127.0.0.1:1"], free_port, scenario)
    assert answers == [(400, "the request body is not JSON"), (400, "the request body must be a JSON object")]


def test_no_backend_reachable_is_a_502(free_port):
    answers = []

    async def scenario(proxy, post):
        answers.append(await post({"prompt": "w5"}))

    stats = run_proxy({}, [f"http://127.0.0.1:{free_port()}"], free_port, scenario)
    assert answers[0][0] == 502 and "no backend reachable" in answers[0][1]
    assert stats["backends"][0]["in_flight"] == 0
