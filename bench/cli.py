"""One entry to every bench: `lmcache-triton bench COMMAND [args...]` or `python -m bench COMMAND [args...]`.

Each command forwards its arguments to that bench module's `main(argv)` (`COMMAND --help` shows
them). Every bench writes a JSON result (device, commit, time) under bench/results/. `--plot`
draws a PNG next to it; for benches without their own plotting the harness draws it from the JSON
(matplotlib, the `bench` extra, imported only then).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path


# `storage` runs two modules with different flags: each gets its own (value-taking flags map to 1),
# and --repeats, which both have under different names, becomes remote's --reps.
_STORAGE_FLAGS = {"bench.storage_local": {"--repeats": 1, "--layers": 1, "--tokens": 1, "--hidden": 1, "--dir": 1,
                                          "--fsync": 0},
                  "bench.storage_remote": {"--reps": 1, "--no-redis": 0}}


def argv_for(module: str, argv: list[str]) -> list[str]:
    """The part of `argv` a storage module accepts (others get argv unchanged)."""
    if module not in _STORAGE_FLAGS or any(a in ("-h", "--help") for a in argv):
        return list(argv)
    own, out, i = _STORAGE_FLAGS[module], [], 0
    while i < len(argv):
        flag, _, inline = argv[i].partition("=")
        if module == "bench.storage_remote" and flag == "--repeats":
            flag = "--reps"
        other = next(f for m, f in _STORAGE_FLAGS.items() if m != module)
        n = own.get(flag)
        if n is None and flag in other:  # the other module's flag: skip it and its value
            i += 1 + (other[flag] if not inline else 0)
            continue
        if n is None:  # nobody's flag: pass it on, so the module's argparse names the mistake
            out.append(argv[i])
            i += 1
            continue
        out += [f"{flag}={inline}"] if inline else [flag, *argv[i + 1:i + 1 + n]]
        i += 1 + (n if not inline else 0)
    return out


@dataclass(frozen=True)
class Command:
    modules: tuple[str, ...]   # run in order with the same argv (storage = local then remote)
    help: str
    own_plot: bool = False     # the module takes --plot itself


COMMANDS = {
    "kernels": Command(("bench.kernels",), "paged gather/scatter GB/s vs the torch reference and a plain copy",
                       own_plot=True),
    "engine": Command(("bench.engine",), "store/lookup/retrieve of one long prompt through the engine"),
    "startup": Command(("bench.startup",), "CPU tier start-up, page commit, and the first store into a fresh engine"),
    "lookup": Command(("bench.lookup",), "lookup and key hashing of one long prompt (scheduler and worker side)"),
    "storage": Command(("bench.storage_local", "bench.storage_remote"),
                       "serde, disk tier, then remote tier (cache server, Redis) throughput"),
    "e2e": Command(("bench.e2e",), "vLLM without/with the connector: multi-round QA and long-document QA",
                   own_plot=True),
    "compare": Command(("bench.compare",), "the same engine workload on lmcache_triton and on LMCache",
                       own_plot=True),
    "ttft": Command(("bench.ttft",), "vLLM time to first token: cold without/with the connector (interleaved), "
                                     "warm vs its floor", own_plot=True),
    "warm-path": Command(("bench.warm_path",), "a warm request's time inside vLLM, call by call of the connector, "
                         "against a plain copy of its KV"),
    "gpu-check": Command(("bench.gpu_check",), "the first run on a GPU host: every GPU target's verdict, "
                         "CPU-possible sections here"),
    "pd": Command(("bench.pd",), "prefill/decode disaggregation (prefiller + decoder + proxy) vs one instance: "
                  "TTFT and inter-token latency on long documents and multi-round chat"),
    "slow-tier": Command(("bench.slow_tier",), "time to first token through a slow remote tier: without the "
                         "connector, load_policy always, load_policy cost", own_plot=True),
    "kv-proxy": Command(("bench.kv_proxy",), "two vLLM instances behind lmcache-triton proxy: KV-aware routing "
                        "against round-robin (hit rate, TTFT p50/p99)", own_plot=True),
    "prefix-cache": Command(("bench.prefix_cache",), "vLLM's own prefix cache without/with the connector as the "
                            "working set outgrows vLLM's KV pool (vllm bench serve)", own_plot=True),
}


def _new_results(name: str, since: float) -> list[Path]:
    from bench.common import RESULTS

    return sorted(p for p in RESULTS.glob(f"{name}-*.json") if p.stat().st_mtime >= since)


def _rows_plot(path: Path, title: str) -> dict[str, dict[str, float]]:
    """{row label: {series: value}} from a result's rows: text fields label a row, *_GBps fields are bars."""
    groups = {}
    for r in json.loads(path.read_text()).get("rows", []):
        label = " ".join(str(v) for k, v in r.items() if isinstance(v, str))
        series = {k: v for k, v in r.items() if k.lower().endswith("gbps") and isinstance(v, (int, float))}
        if series:
            groups[label] = series
    return groups


def plot_result(module: str, path: Path) -> Path:
    """The PNG for a bench that has no --plot of its own, drawn from the JSON it wrote."""
    from bench.common import plot_bars

    data = json.loads(path.read_text())
    png = path.with_suffix(".png")
    if module == "bench.engine":
        groups = {"GB/s": {k: data[k] for k in ("store_gbps", "store_first_gbps", "retrieve_gbps", "plain_copy_gbps")}}
        title = f"engine, {data['tokens']} tokens x {data['layers']} layers ({data['layout']})"
        return plot_bars(png, title, groups, "GB/s")
    return plot_bars(png, module.split(".")[-1], _rows_plot(path, module), "GB/s")


def run(name: str, argv: list[str]) -> int:
    cmd = COMMANDS[name]
    plot = "--plot" in argv and not cmd.own_plot
    if plot:
        argv = [a for a in argv if a != "--plot"]
        from bench.common import MatplotlibMissing, pyplot

        try:
            pyplot()  # fail before a long run, not after it
        except MatplotlibMissing as e:
            print(e, file=sys.stderr)
            return 2
    rc, prog = 0, sys.argv[0]
    sys.argv[0] = f"bench {name}"  # the modules' argparse usage lines name the command
    try:
        rc = _run_modules(cmd, argv, plot)
    finally:
        sys.argv[0] = prog
    return rc


def _run_modules(cmd: Command, argv: list[str], plot: bool) -> int:
    rc = 0
    for module in cmd.modules:
        since = time.time() - 1
        out = importlib.import_module(module).main(argv_for(module, argv))
        if isinstance(out, int) and out != 0:
            rc = out
        if plot:
            for path in _new_results(module.split(".")[-1], since):
                print(f"wrote {plot_result(module, path)}")
    return rc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmcache-triton bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=list(COMMANDS), metavar="COMMAND",
                   help="; ".join(f"{k}: {c.help}" for k, c in COMMANDS.items()))
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the bench (COMMAND --help lists them)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        build_parser().parse_args(argv[:1])  # prints the usage error, exits 2
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
