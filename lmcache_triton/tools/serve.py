"""`lmcache-triton serve MODEL [vLLM args...]`: vLLM's OpenAI-compatible server with the connector.

Runs `vllm serve MODEL [vLLM args...]` (vLLM's own command line, in this process) with these
defaults, each applied only when the user has not set it (on the command line or in vLLM's
`--config` YAML file):

- `--kv-transfer-config '{"kv_connector": "LMCacheTritonConnectorV1", "kv_role": "kv_both"}'`;
- `--no-enable-prefix-caching`: with vLLM's own prefix cache on, a repeated prompt is served from
  vLLM's paged cache and never reaches the connector (pass `--enable-prefix-caching` to keep both);
- on vLLM's CPU build only: `VLLM_CPU_KVCACHE_SPACE` (GiB of vLLM's KV cache) = a quarter of the
  available memory, at least 1 and at most 4, unless `--kv-cache-memory-bytes` or
  `--gpu-memory-utilization` is given (by default vLLM's CPU worker asks for 0.92 of the host's
  memory and refuses to start when less is free, as on a 24 GiB host); and `--enforce-eager` unless `--enforce-eager`,
  `--no-enforce-eager`, `--compilation-config`/`-cc` or `-O`/`--optimization-level` is given (vLLM's
  CPU build otherwise compiles the model with TorchInductor at start: a C++ compiler and minutes of
  start-up on a small host).

Every argument after MODEL goes to vLLM unchanged. Why not `vllm serve` itself: on vllm-cpu the
`vllm` command fails at once, because its command line asks `importlib.metadata.version("vllm")`
and that distribution is named `vllm-cpu`. Here that one question is answered with vllm-cpu's
version (as vLLM's own platform check does: "<version>+cpu"); vLLM's files are not edited.
Nothing here imports vLLM before the server starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from importlib import metadata as importlib_metadata
from importlib.util import find_spec
from pathlib import Path

CONNECTOR = "LMCacheTritonConnectorV1"
DEFAULT_KV_TRANSFER_CONFIG = {"kv_connector": CONNECTOR, "kv_role": "kv_both"}
KV_CACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
MAX_DEFAULT_KV_CACHE_GIB = 4

_PREFIX_CACHING = {"enable-prefix-caching", "no-enable-prefix-caching"}
_COMPILATION = {"enforce-eager", "no-enforce-eager", "compilation-config", "optimization-level"}
_KV_CACHE_SIZE = {"kv-cache-memory-bytes", "gpu-memory-utilization"}


def vllm_distribution() -> tuple[str, str] | None:
    """(name, version) of the installed distribution that provides the `vllm` package: `vllm` on
    CUDA hosts, `vllm-cpu` for vLLM's CPU build; None when vLLM is not installed."""
    try:
        return "vllm", importlib_metadata.version("vllm")
    except importlib_metadata.PackageNotFoundError:
        pass
    for name in importlib_metadata.packages_distributions().get("vllm", []):
        try:
            return name, importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            continue
    return None


def is_cpu_build(dist: tuple[str, str] | None) -> bool:
    """vLLM's own test (vllm.platforms.vllm_version_matches_substr("cpu")): the distribution is
    vllm-cpu or its version carries "cpu" (a "+cpu" local version)."""
    return dist is not None and ("cpu" in dist[0].lower() or "cpu" in dist[1].lower())


def _option_name(arg: str) -> str | None:
    """The option an argument sets, as vLLM's FlexibleArgumentParser reads it (`_` and `-` alike,
    `--a.b value` and `--a=value` set `a`); None for values and short options we do not track."""
    if arg.startswith("--") and len(arg) > 2:
        return arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    if arg.startswith("-O"):
        return "optimization-level"
    if arg == "-cc" or arg.startswith(("-cc.", "-cc=")):
        return "compilation-config"
    return None


def given_options(vllm_args: list[str]) -> set[str]:
    """Names of the vLLM options the user set, on the command line or in the YAML file named by
    `--config` (vLLM reads its keys as options)."""
    names = {n for n in map(_option_name, vllm_args) if n}
    for i, arg in enumerate(vllm_args):
        path = None
        if arg == "--config" and i + 1 < len(vllm_args):
            path = vllm_args[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        if path:
            try:
                import yaml

                data = yaml.safe_load(Path(path).read_text())
            except (OSError, ValueError, ImportError):  # vLLM reports an unreadable file itself
                continue
            if isinstance(data, dict):
                names |= {str(k).replace("_", "-") for k in data}
    return names


def default_kv_cache_space_gib(meminfo: str = "/proc/meminfo") -> int:
    """A quarter of the available memory in GiB, at least 1, at most MAX_DEFAULT_KV_CACHE_GIB."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail_gib = int(line.split()[1]) / (1 << 20)  # kB
                return max(1, min(MAX_DEFAULT_KV_CACHE_GIB, int(avail_gib // 4)))
    except (OSError, ValueError, IndexError):
        pass
    return MAX_DEFAULT_KV_CACHE_GIB


def plan(model: str, vllm_args: list[str], *, cpu: bool,
         environ: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The arguments of `vllm serve` (MODEL first, the user's arguments unchanged, then our
    defaults) and the environment variables to set."""
    environ = os.environ if environ is None else environ
    given = given_options(vllm_args)
    argv = [model, *vllm_args]
    env: dict[str, str] = {}
    if "kv-transfer-config" not in given:
        argv += ["--kv-transfer-config", json.dumps(DEFAULT_KV_TRANSFER_CONFIG)]
    if not given & _PREFIX_CACHING:
        argv.append("--no-enable-prefix-caching")
    if cpu:
        if not given & _COMPILATION:
            argv.append("--enforce-eager")
        if not environ.get(KV_CACHE_SPACE_ENV) and not given & _KV_CACHE_SIZE:
            env[KV_CACHE_SPACE_ENV] = str(default_kv_cache_space_gib())
    return argv, env


def _answer_vllm_version_from(dist: tuple[str, str]) -> None:
    """Makes importlib.metadata.version("vllm") answer for vllm-cpu in this process (vLLM's
    command line asks it for `--version`); a no-op where a `vllm` distribution exists."""
    name, version = dist
    if name == "vllm":
        return
    alias = version if "cpu" in version or "cpu" not in name.lower() else f"{version}+cpu"
    original = importlib_metadata.version

    def version_(distribution_name: str) -> str:
        if distribution_name.lower().replace("_", "-") == "vllm":
            return alias
        return original(distribution_name)

    importlib_metadata.version = version_


def serve(model: str, vllm_args: list[str], *, dry_run: bool = False) -> int:
    dist = vllm_distribution()
    if dist is None or find_spec("vllm") is None:
        print("lmcache-triton serve: vLLM is not installed (CPU hosts: pip install 'lmcache-triton[cpu]'; "
              "CUDA hosts: pip install 'lmcache-triton[vllm]')", file=sys.stderr)
        return 2
    argv, env = plan(model, vllm_args, cpu=is_cpu_build(dist))
    shown = [f"{k}={v}" for k, v in env.items()] + ["vllm", "serve", *argv]
    print(f"lmcache-triton serve ({dist[0]} {dist[1]}): {shlex.join(shown)}", file=sys.stderr, flush=True)
    if dry_run:
        return 0
    os.environ.update(env)
    _answer_vllm_version_from(dist)
    sys.argv = [sys.argv[0] if sys.argv else "lmcache-triton", "serve", *argv]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    return serve(args.model, list(args.vllm_args), dry_run=args.dry_run)


def add_serve_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser(
        "serve", help="vLLM's OpenAI-compatible server with the connector: serve MODEL [vLLM args...]",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--dry-run", action="store_true",
                   help="print the vLLM command and environment that would run, and exit (before MODEL)")
    s.add_argument("model", help="a model name or local folder (vLLM's `vllm serve MODEL`)")
    s.add_argument("vllm_args", nargs=argparse.REMAINDER,
                   help="every argument after MODEL goes to `vllm serve` unchanged (`serve MODEL --help` "
                        "shows vLLM's)")
    s.set_defaults(func=cmd_serve)
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmcache_triton.tools.serve")
    add_serve_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
