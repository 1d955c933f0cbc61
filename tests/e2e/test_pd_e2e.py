"""Prefill/decode disaggregation as a user deploys it: a prefiller and a decoder (`lmcache-triton
serve` on the tiny random Llama, configured by LMCACHE_* variables as examples/pd/ shows) and
`lmcache-triton proxy`, all real processes, asked through the proxy's OpenAI API.

It checks that the proxy's answers equal a single instance's (the prefiller asked directly: a
kv_producer computes every token itself), that the decoder computed only the last prompt token
(vLLM's own usage.prompt_tokens_details.cached_tokens), and that the faults end in misses: a
prompt larger than the decoder's receive buffer, a decoder that is gone (the prefiller still
answers, at once), a prefiller killed mid-request and then gone (the decoder computes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lmcache_triton.tools.models import random_prompt
from lmcache_triton.tools.testing import stop_session
from test_openai_serve_e2e import _get, _wait_for

CHUNK = 256
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 32 * 2  # the tiny Llama: 2 layers, K and V, 2 KV heads x 32, bf16
BUFFER_CHUNKS = 8


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("lmcache-triton")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_triton.tools.cli"]


def _start(cmd: list[str], env_extra: dict[str, str], log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env.pop("TRITON_INTERPRET", None)
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25"} | env_extra)
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _healthy(proc: subprocess.Popen, base: str, log: Path):
    def check():
        if proc.poll() is not None:
            raise RuntimeError(f"{log.name} exited with {proc.returncode}:\n{log.read_text()[-6000:]}")
        try:
            return _get(base + "/health", timeout=2) is not None
        except OSError:
            return False
    return check


def _cached(usage) -> int:
    details = getattr(usage, "prompt_tokens_details", None)
    return (getattr(details, "cached_tokens", None) or 0) if details is not None else 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_prefiller_decoder_and_proxy(tiny_model, free_port, tmp_path, whole_blocks_only):
    openai = pytest.importorskip("openai")
    pytest.importorskip("aiohttp")
    p_port, d_port, pd_port, proxy_port = free_port(), free_port(), free_port(), free_port()
    serve = [*_cli(), "serve", tiny_model, "--host", "127.0.0.1", "--max-model-len", "4096",
             "--enable-prompt-tokens-details"]

    def kv(role: str) -> list[str]:
        return ["--kv-transfer-config", json.dumps({"kv_connector": "LMCacheTritonConnectorV1", "kv_role": role})]

    logs = {name: tmp_path / f"{name}.log" for name in ("prefiller", "decoder", "proxy")}
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["prefiller"] = _start([*serve, "--port", str(p_port), *kv("kv_producer")],
                                    dict(LMCACHE_ENABLE_PD="true", LMCACHE_PD_ROLE="sender"), logs["prefiller"])
        procs["decoder"] = _start([*serve, "--port", str(d_port), *kv("kv_consumer")],
                                  dict(LMCACHE_ENABLE_PD="true", LMCACHE_PD_ROLE="receiver",
                                       LMCACHE_PD_PEER_HOST="127.0.0.1", LMCACHE_PD_PEER_INIT_PORT=str(pd_port),
                                       LMCACHE_PD_BUFFER_SIZE=str(BUFFER_CHUNKS * CHUNK_BYTES)), logs["decoder"])
        procs["proxy"] = _start([*_cli(), "proxy", "--port", str(proxy_port),
                                 "--prefiller", f"http://127.0.0.1:{p_port}",
                                 "--decoder", f"http://127.0.0.1:{d_port}",
                                 "--decoder-pd", f"127.0.0.1:{pd_port}"], {}, logs["proxy"])
        for name, port in (("prefiller", p_port), ("decoder", d_port), ("proxy", proxy_port)):
            _wait_for(_healthy(procs[name], f"http://127.0.0.1:{port}", logs[name]), 400, f"the {name}'s /health")

        def client(port: int):
            return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=120, max_retries=0)

        prefiller, proxy = client(p_port), client(proxy_port)
        model = proxy.models.list().data[0].id

        def words(n: int, seed: int) -> str:  # the word-level tokenizer: 1 word, 1 token
            return " ".join(f"w{t}" for t in random_prompt(n, seed=seed))

        def ask(c, prompt: str, **kw):
            return c.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=8, **kw)

        doc = words(1000, seed=11)
        follow_up = doc + " " + words(300, seed=12)  # the same document, a longer question
        for prompt in (doc, follow_up):
            single = ask(prefiller, prompt)  # a kv_producer never loads: a single instance's answer
            out = ask(proxy, prompt)
            n = out.usage.prompt_tokens
            assert out.choices[0].text == single.choices[0].text and len(out.choices[0].text.split()) == 8
            # on an AMX CPU only whole chunks move (no partial chunk is saved or sent)
            expected = (n - 1) // CHUNK * CHUNK if whole_blocks_only else n - 1
            assert _cached(out.usage) == expected, "the decoder computed only what was not sent"
        streamed = "".join(c.choices[0].text for c in ask(proxy, doc, stream=True) if c.choices)
        assert streamed == ask(prefiller, doc).choices[0].text, "the proxy streams the decoder's answer"

        # A prompt larger than the decoder's receive buffer evicts its own first chunks: a miss.
        big = words(BUFFER_CHUNKS * CHUNK + 2 * CHUNK, seed=13)
        out = ask(proxy, big)
        assert out.choices[0].text == ask(prefiller, big).choices[0].text
        assert _cached(out.usage) == 0

        # A decoder that is gone: the prefiller answers at once (its transfer fails fast).
        gone = {"disagg_spec": {"req_id": "gone", "receiver_host": "127.0.0.1", "receiver_init_port": [free_port()]}}
        t0 = time.monotonic()
        lone = prefiller.completions.create(model=model, prompt=words(600, seed=14), temperature=0, max_tokens=1,
                                            extra_body={"kv_transfer_params": gone})
        assert time.monotonic() - t0 < 20 and lone.choices[0].text
        assert ask(prefiller, words(600, seed=14)).choices[0].text.startswith(lone.choices[0].text)

        # A prefiller killed in the middle of a request (computing or sending: whichever it was
        # doing): the proxy's request still ends, answered by the decoder, which loads whatever
        # whole prefix arrived and computes the rest.
        killed = words(1800, seed=15)
        single = ask(prefiller, killed)
        answers: list = []
        asking = threading.Thread(target=lambda: answers.append(ask(proxy, killed)))
        asking.start()
        time.sleep(0.15)
        os.killpg(procs["prefiller"].pid, signal.SIGKILL)
        asking.join(180)
        assert not asking.is_alive() and answers, "the request through the proxy hung"
        assert answers[0].choices[0].text == single.choices[0].text
        # ... and while it is gone, the decoder computes every prompt itself.
        late = words(700, seed=16)
        out = ask(proxy, late)
        assert len(out.choices[0].text.split()) == 8 and _cached(out.usage) == 0
        assert ask(client(d_port), late).choices[0].text == out.choices[0].text
    finally:
        for proc in procs.values():
            stop_session(proc)
