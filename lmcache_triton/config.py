"""Engine configuration: :class:`LMCacheEngineConfig`.

The field names, meanings and (where LMCache has them) defaults follow LMCache's
``lmcache/v1/config.py`` so that an LMCache YAML file or set of ``LMCACHE_*`` variables
works here unchanged for the options this package implements. LMCache's other names are
mapped, ignored with a warning that says why, or refused: see ``_LMCACHE_NAMES``.

This module imports only the standard library and PyYAML, and does nothing at import.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import yaml

__all__ = [
    "ConfigError", "LMCacheEngineConfig", "ENV_PREFIX", "CONFIG_FILE_ENV", "connector_overrides",
    "reset_warnings",
]

logger = logging.getLogger("lmcache_triton")

ENV_PREFIX = "LMCACHE_"
CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
OVERRIDE_PREFIX = "lmcache."

# LMCACHE_* variables that are not config fields but are legitimately set by users of
# LMCache (or read elsewhere); they are ignored silently.
_NON_FIELD_ENV = frozenset(
    {
        "LMCACHE_CONFIG_FILE",
        "LMCACHE_LOG_LEVEL",
        "LMCACHE_USE_EXPERIMENTAL",
        "LMCACHE_TRACK_USAGE",
    }
)
# Names already warned about in this process (warn once each): unknown LMCACHE_* variables and
# the LMCache names of _LMCACHE_NAMES / _CONNECTOR_KEYS that are mapped or ignored.
_warned_env: set[str] = set()

REMOTE_SCHEMES = ("lm", "redis", "rediss", "valkey")
REMOTE_SERDES = ("naive", "lz4")


class ConfigError(ValueError):
    """An invalid configuration value, key, file or environment variable."""


# ---------------------------------------------------------------------------------------
# Field types. Kinds: int, float, bool, str, list[int], list[float], dict.
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Spec:
    kind: str
    optional: bool = False

    def describe(self) -> str:
        return f"{self.kind} or None" if self.optional else self.kind


_SPECS: dict[str, _Spec] = {
    "chunk_size": _Spec("int"),
    "local_cpu": _Spec("bool"),
    "max_local_cpu_size": _Spec("float"),
    "local_disk": _Spec("str", optional=True),
    "max_local_disk_size": _Spec("float"),
    "remote_url": _Spec("str", optional=True),
    "remote_serde": _Spec("str"),
    "remote_auth_token": _Spec("str", optional=True),
    "blocking_timeout_secs": _Spec("float"),
    "use_layerwise": _Spec("bool"),
    "enable_blending": _Spec("bool"),
    "blend_recompute_ratios": _Spec("list[float]"),
    "blend_check_layers": _Spec("list[int]"),
    "blend_min_tokens": _Spec("int"),
    "blend_special_str": _Spec("str"),
    "save_decode_cache": _Spec("bool"),
    "save_unfull_chunk": _Spec("bool"),
    "enable_async_loading": _Spec("bool"),
    "lookup_timeout_ms": _Spec("int"),
    "prometheus_port": _Spec("int", optional=True),
    "reservation_lease_secs": _Spec("float"),
    "verify_hit_rate": _Spec("float"),
    "namespace_secret": _Spec("str", optional=True),
    "extra_config": _Spec("dict", optional=True),
}

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_NONE = frozenset({"none", "null", ""})


def _suggest(name: str, candidates) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else ""


def _unknown_key(key: Any, source: str = "", bare: str | None = None) -> ConfigError:
    where = f" in {source}" if source else ""
    hint = _suggest(str(key) if bare is None else bare, _SPECS)
    return ConfigError(
        f"unknown config key {key!r}{where}{hint} "
        f"(valid keys: {', '.join(_SPECS)})"
    )


def _type_error(key: str, spec: _Spec, value: Any) -> ConfigError:
    return ConfigError(
        f"invalid value for '{key}': expected {spec.describe()}, "
        f"got {type(value).__name__} {value!r}"
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _coerce(key: str, value: Any) -> Any:
    """Check ``value`` against the field's type; return it normalized (int -> float for
    float fields, tuples -> lists, a lone scalar -> one-element list as LMCache accepts)."""
    spec = _SPECS[key]
    if value is None:
        if spec.optional:
            return None
        raise _type_error(key, spec, value)
    kind = spec.kind
    if kind == "int":
        if _is_int(value):
            return value
    elif kind == "float":
        if _is_number(value):
            value = float(value)
            if math.isfinite(value):
                return value
            raise ConfigError(f"invalid value for '{key}': must be a finite number, got {value!r}")
    elif kind == "bool":
        if isinstance(value, bool):
            return value
    elif kind == "str":
        if isinstance(value, str):
            return value
    elif kind in ("list[int]", "list[float]"):
        elem_ok = _is_int if kind == "list[int]" else _is_number
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if all(elem_ok(x) for x in items):
            if kind == "list[float]":
                items = [float(x) for x in items]
            return items
    elif kind == "dict":
        if isinstance(value, Mapping):
            if all(isinstance(k, str) for k in value):
                return dict(value)
            raise ConfigError(f"invalid value for '{key}': keys must be strings, got {value!r}")
    raise _type_error(key, spec, value)


# ---------------------------------------------------------------------------------------
# LMCache's other names: one table says what becomes of every configuration name LMCache
# 0.5.x accepts (lmcache/v1/config.py: _CONFIG_DEFINITIONS and _CONFIG_ALIASES, plus the
# older names its published examples still use) that is not a field above.
#
#   alias   the value sets `target` (converted where the unit differs), with a warning
#   ignore  a feature this project does not have: a warning says why, the value is dropped
#   reject  ConfigError: dropping it would silently run something else than asked for
#
# A name whose value equals LMCache's default (`default`) changes nothing and passes without a
# word, so a full LMCache config dump does not drown the warnings that matter. Names in neither
# _SPECS nor this table stay errors (files, overrides) or warnings (LMCACHE_* variables).
# ---------------------------------------------------------------------------------------
_ANY = object()  # no default: any value is acted on
_DROP = object()  # from an alias's convert: this value has no counterpart, ignore it (with the note)


@dataclass(frozen=True)
class _Compat:
    action: str  # "alias" | "ignore" | "reject"
    reason: str
    target: str | None = None  # alias only: the field it sets
    default: Any = _ANY  # LMCache's default: a value equal to it is accepted silently
    # alias only: (name, value) -> (value for target, or _DROP; a note for the warning)
    convert: Any = None


_PD = "prefill/decode disaggregation is not implemented here (issue #15)"
_P2P = "peer-to-peer sharing between instances is not implemented here (share a remote_url store instead)"
_CONTROLLER = "LMCache's cache controller and its workers are not implemented here"
_PLUGINS = "LMCache plugins and extra storage backends do not load here"
_GDS = "GPU Direct Storage and other LMCache-only tiers are not implemented here (use local_disk)"
_ALLOC = "the CPU tier here is one pinned pool of max_local_cpu_size, allocated at start"
_STATS = "LMCache's chunk statistics, KV events and API servers are not implemented here (see prometheus_port)"
_HIDDEN = "hidden-state caching (vLLM-Omni) is not implemented here"
_SPARSE = "this LMCache tuning knob has no counterpart here"


def _ratio_from_lmcache(name: str, value: Any) -> tuple[Any, str]:
    """LMCache's old `blend_recompute_ratio` (one float, default 0.15: a fraction). Its RAG
    benchmark example writes `blend_recompute_ratio: 15  # default`, a percentage: values above 1
    (up to 100) are read as percentages."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items or not all(_is_number(x) for x in items) or any(not 0 <= x <= 100 for x in items):
        raise ConfigError(
            f"invalid value for '{name}' (LMCache's old name of blend_recompute_ratios): expected "
            f"a fraction in [0, 1] or a percentage in (1, 100], got {value!r}"
        )
    if any(x > 1 for x in items):
        return [x / 100 for x in items], f" ({value!r} read as a percentage; LMCache's default 0.15 is a fraction)"
    return [float(x) for x in items], ""


def _same(name: str, value: Any) -> tuple[Any, str]:
    return value, ""


def _discard_partial(name: str, value: Any) -> tuple[Any, str]:
    """vLLM connector key `discard_partial_chunks`: LMCache discards partial chunks when it is
    true or save_unfull_chunk is false, so true means save_unfull_chunk=False (false: no effect)."""
    if isinstance(value, str) and value.strip().lower() in _TRUE:
        value = True
    if value is not True:
        raise ConfigError(
            f"invalid value for kv_connector_extra_config key '{name}': expected bool, got {value!r}"
        )
    return False, ""


def _local_device(name: str, value: Any) -> tuple[Any, str]:
    """LMCache v0's `local_device`: "cpu" is the CPU tier; "cuda" (v0's default) a GPU-memory
    cache, which does not exist here; "file://dir/" a disk cache that needs a size here."""
    text = str(value).strip() if value is not None else ""
    if text == "cpu":
        return True, " (LMCache v0's CPU device is the local_cpu tier)"
    if text.startswith("file://") or text.startswith("/"):
        raise ConfigError(
            f"cannot honour {name}={value!r} (LMCache v0's disk device): write it as "
            f"local_disk: {value!r} with max_local_disk_size: <GB>"
        )
    return _DROP, " (there is no GPU-memory tier here; chunks live in the CPU tier)"


def _ignore(reason: str, default: Any = None) -> _Compat:
    return _Compat("ignore", reason, default=default)


_LMCACHE_NAMES: dict[str, _Compat] = {
    # Old or LMCache-only names of fields here.
    "blend_recompute_ratio": _Compat("alias", "LMCache's old name of blend_recompute_ratios",
                                     target="blend_recompute_ratios", convert=_ratio_from_lmcache),
    "pin_timeout_sec": _Compat("alias", "LMCache's forced-unpin timeout is reservation_lease_secs here",
                               target="reservation_lease_secs", convert=_same),
    # LMCache v0's config (lmcache/config.py), still in some of its published examples.
    "local_device": _Compat("alias", "LMCache v0's name", target="local_cpu", convert=_local_device),
    "max_local_cache_size": _Compat("alias", "LMCache v0's name of the CPU tier's size in GB",
                                    target="max_local_cpu_size", convert=_same),
    "blend_separator": _Compat("alias", "LMCache v0's name of blend_special_str",
                               target="blend_special_str", convert=_same),
    "pipelined_backend": _ignore("LMCache v0's pipelined retrieve; see use_layerwise", False),
    "blend_add_special_in_precomp": _ignore("LMCache v0's CacheBlend option; not implemented here", False),
    # Honoured by behaviour: the tiers here evict least recently used chunks, as LMCache's default.
    "cache_policy": _ignore("only LRU eviction is implemented here", "LRU"),
    # Not safe to drop: the configuration asked for would never be applied.
    "remote_config_url": _Compat("reject", "fetching configuration from a remote service is not "
                                 "supported here; put its settings in the config file", default=None),
    "app_id": _ignore("remote configuration (remote_config_url) is not supported here"),
    # Prefill/decode disaggregation, and its older nixl_* / xpyd names.
    **{k: _ignore(_PD, d) for k, d in {
        "enable_pd": False, "pd_role": None, "pd_buffer_size": None, "pd_buffer_device": None,
        "pd_peer_host": None, "pd_peer_init_port": None, "pd_peer_alloc_port": None,
        "pd_peer_query_port": None, "pd_proxy_host": None, "pd_proxy_port": None,
        "pd_allocation_timeout_sec": float("inf"), "pd_shutdown_timeout_sec": 5.0,
        "pd_condition_poll_interval_sec": 0.005, "pd_max_prefill_len": 0, "pd_backend_mode": "async",
        "pd_skip_proxy_notification": False, "pd_bidirectional": False, "transfer_channel": None,
        "nixl_backends": None, "nixl_buffer_size": None, "nixl_buffer_device": None,
        "enable_xpyd": False, "enable_nixl": False, "nixl_role": None, "nixl_receiver_host": None,
        "nixl_receiver_port": None, "nixl_peer_port": None, "nixl_enable_gc": False,
        "nixl_peer_host": None, "nixl_peer_init_port": None, "nixl_peer_alloc_port": None,
        "nixl_proxy_host": None, "nixl_proxy_port": None,
    }.items()},
    **{k: _ignore(_P2P, d) for k, d in {
        "enable_p2p": False, "p2p_host": None, "p2p_init_ports": None, "p2p_lookup_ports": None,
    }.items()},
    **{k: _ignore(_CONTROLLER, d) for k, d in {
        "enable_controller": False, "lmcache_instance_id": None, "controller_pull_url": None,
        "controller_reply_url": None, "controller_url": None, "lmcache_worker_ports": None,
        "lmcache_worker_port": None, "lmcache_worker_ids": None,
        "lmcache_worker_heartbeat_delay_time": 10, "lmcache_worker_heartbeat_time": None,
    }.items()},
    **{k: _ignore(_PLUGINS, None) for k in (
        "runtime_plugin_locations", "plugin_locations", "storage_plugins", "external_backends",
        "remote_storage_plugins", "external_lookup_client", "script_allowed_imports",
        "audit_actual_remote_url",
    )},
    "mp_host": _ignore("LMCache's multi-process server (for SGLang) is not implemented here", None),
    "mp_port": _ignore("LMCache's multi-process server (for SGLang) is not implemented here", 5555),
    **{k: _ignore(_GDS, d) for k, d in {
        "gds_path": None, "gds_path_sharding": "by_gpu", "gds_buffer_size": None, "use_gds": True,
        "gds_backend": "cufile", "maru_path": None, "maru_pool_size": 4.0,
        "local_disk_path_sharding": "by_gpu", "retrieve_locations": None, "store_location": None,
    }.items()},
    **{k: _ignore(_ALLOC, d) for k, d in {
        "local_cpu_use_hugepages": False, "reserve_local_cpu_size": 0.0, "numa_mode": None,
        "enable_lazy_memory_allocator": False, "lazy_memory_initial_ratio": 0.2,
        "lazy_memory_expand_trigger_ratio": 0.5, "lazy_memory_step_ratio": 0.1,
        "lazy_memory_safe_size": 0.0,
    }.items()},
    "pin_check_interval_sec": _ignore("reservations here expire lazily after reservation_lease_secs, with no monitor thread", 30),
    "py_enable_gc": _ignore("this LMCache tuning knob has no counterpart here", True),
    **{k: _ignore(_STATS, d) for k, d in {
        "internal_api_server_enabled": False, "internal_api_server_host": "0.0.0.0",
        "internal_api_server_port_start": 6999, "internal_api_server_include_index_list": None,
        "internal_api_server_socket_path_prefix": None, "enable_chunk_statistics": False,
        "chunk_statistics_auto_start_statistics": False,
        "chunk_statistics_auto_exit_timeout_hours": 0.0,
        "chunk_statistics_auto_exit_target_unique_chunks": 0,
        "chunk_statistics_strategy": "memory_bloom_filter", "enable_kv_events": False,
    }.items()},
    **{k: _ignore(_HIDDEN, d) for k, d in {
        "enable_hidden_state_cache": False, "max_hidden_state_cpu_size": 2.0,
        "hidden_state_layers": None, "hidden_states_retrieve_mode": "prefix_strict",
    }.items()},
    **{k: _ignore(_SPARSE, d) for k, d in {
        "min_retrieve_tokens": 0, "priority_limit": None, "hit_miss_ratio": None,
        "lookup_server_worker_ids": None, "enable_scheduler_bypass_lookup": False,
        "use_gpu_connector_v3": False, "cost_aware_half_life_seconds": 60.0,
        "cost_aware_ewma_alpha": 0.2,
    }.items()},
    "pre_caching_hash_algorithm": _ignore(
        "chunk keys here are keyed digests of their own (see namespace_secret)", "builtin"),
    "blend_thresholds": _ignore(
        "CacheBlend here selects tokens by blend_recompute_ratios only", None),
}

# Values of fields that LMCache accepts and this project does not: field -> value -> (used
# instead, why). Applied to files, LMCACHE_* variables and kv_connector_extra_config, with a warning.
_LMCACHE_VALUES: dict[str, dict[Any, tuple[Any, str]]] = {
    "remote_serde": {
        None: ("naive", "LMCache allows null (no serde chosen): the default"),
        "cachegen": ("lz4", "LMCache's lossy cachegen codec is not implemented here; lz4 is lossless"),
    },
}

# remote_url schemes of LMCache's backends that a backend here serves: scheme -> (used instead, why).
_LMCACHE_SCHEMES: dict[str, tuple[str, str]] = {
    "resp": ("redis", "LMCache's RESP backend speaks the Redis protocol, as the redis backend here does"),
}

# extra_config keys LMCache's remote backends (redis, valkey, resp) read and the backends here do not.
_CREDENTIALS = "give credentials in remote_url (redis://user:password@host:port) or remote_auth_token"
_LMCACHE_EXTRA_KEYS: dict[str, str] = {
    **{k: _CREDENTIALS for k in ("valkey_username", "valkey_password", "username", "password",
                                 "redis_username", "redis_password")},
    "valkey_database": "give the database in remote_url (valkey://host:port/db)",
    "redis_database": "give the database in remote_url (redis://host:port/db)",
    "valkey_mode": "cluster mode is not implemented here (one host:port)",
    "redis_mode": "cluster mode is not implemented here (one host:port)",
}
# extra_config keys whose values to_dict(redact=True) hides.
_SECRET_WORDS = ("pass", "secret", "token", "credential")

# LMCACHE_* variables LMCache reads elsewhere than in its config (the vLLM connector).
_LMCACHE_ENV_ONLY: dict[str, _Compat] = {
    "LMCACHE_FORCE_SKIP_SAVE": _ignore("forcing every save off is not implemented here", ""),
}

# kv_connector_extra_config keys LMCache's vLLM connector reads WITHOUT the `lmcache.` prefix
# (lmcache/integration/vllm/vllm_v1_adapter.py), and vLLM's wrapper of it.
_CONNECTOR_KEYS: dict[str, _Compat] = {
    # LMCache: partial chunks are discarded when this is true OR save_unfull_chunk is false.
    "discard_partial_chunks": _Compat(
        "alias", "LMCache's connector discards partial chunks when it is true",
        target="save_unfull_chunk", default=False,
        convert=_discard_partial),
    "lmcache_rpc_port": _ignore(
        "not needed: lookup sockets here are named by vLLM's engine_id, unique per instance", 0),
    "skip_last_n_tokens": _ignore("skipping prompt tokens at lookup is for PD decoders (issue #15)", 0),
    "use_native": _ignore("it picks vLLM's copy of LMCache's connector, not this one", False),
}


def reset_warnings() -> None:
    """Forget which names were warned about, so the next load warns about each again."""
    _warned_env.clear()


def _warn_once(name: str, message: str) -> None:
    if name not in _warned_env:
        _warned_env.add(name)
        logger.warning("%s", message)


def _matches_default(value: Any, default: Any) -> bool:
    """`value` (typed, or the text of an environment variable) equals LMCache's default."""
    if default is _ANY:
        return False
    if isinstance(value, str):
        text = _unquote(value).strip()
        low = text.lower()
        if default is None:
            return low in _NONE
        if isinstance(default, bool):
            return low in (_TRUE if default else _FALSE)
        if isinstance(default, (int, float)):
            try:
                return float(text) == default
            except ValueError:
                return False
        return isinstance(default, str) and low == default.lower()
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if default is None or value is None:
        return value is default
    if _is_number(value) and _is_number(default):
        return float(value) == float(default)
    return False


def _apply_compat(name: str, entry: _Compat, value: Any, where: str, out: dict[str, Any],
                  parse_env: bool = False) -> None:
    """Act on one LMCache name (see _LMCACHE_NAMES); an alias writes its target into `out`.
    `parse_env`: `value` is the text of the environment variable `name`."""
    shown = f"{name} ({where})" if where else name
    if _matches_default(value, entry.default):
        return  # LMCache's default: nothing to honour, drop or refuse
    if entry.action == "reject":
        raise ConfigError(f"cannot honour {shown}: {entry.reason}")
    if entry.action == "ignore":
        _warn_once(name, f"{entry.reason}; ignoring {shown}")
        return
    target = entry.target
    assert entry.action == "alias" and target is not None
    if parse_env:
        try:
            value = _parse_env(target, value)
        except ConfigError:
            raise ConfigError(
                f"cannot parse environment variable {name}={value!r}: "
                f"expected {_SPECS[target].describe()}"
            ) from None
    converted, note = entry.convert(name, value)
    if converted is _DROP:
        _warn_once(name, f"{shown}: {entry.reason}; ignoring it{note}")
        return
    if target in out:
        try:
            existing = _coerce(target, out[target])
        except ConfigError:
            existing = out[target]
        if existing != _coerce(target, converted):
            raise ConfigError(
                f"{shown} and '{target}' are both given, with different values "
                f"({value!r} and {out[target]!r}); keep '{target}' only"
            )
    out[target] = converted
    _warn_once(name, f"{shown}: {entry.reason}; using {target}={converted!r}{note}")


def _translate_values(values: dict[str, Any], where: str) -> None:
    """Replace (in place) the field values LMCache accepts and this project does not."""
    extra = values.get("extra_config")
    if isinstance(extra, Mapping):
        for k, hint in _LMCACHE_EXTRA_KEYS.items():
            if k in extra:
                _warn_once(f"extra_config.{k}", f"extra_config.{k} ({where}) is not read here: {hint}")
    url = values.get("remote_url")
    if isinstance(url, str) and "://" in url:
        scheme, rest = url.split("://", 1)
        if scheme in _LMCACHE_SCHEMES:
            used, why = _LMCACHE_SCHEMES[scheme]
            values["remote_url"] = f"{used}://{rest}"
            _warn_once(f"remote_url={scheme}", (
                f"{why}; using remote_url={_redact_url(values['remote_url'])!r} "
                f"for {scheme}:// ({where})"))
    for key, table in _LMCACHE_VALUES.items():
        value = values.get(key, _ANY)
        if value is _ANY or not isinstance(value, (str, type(None))) or value not in table:
            continue
        used, why = table[value]
        values[key] = used
        if value is not None:
            shown = f"{key}={value!r}" + (f" ({where})" if where else "")
            _warn_once(f"{key}={value}", f"{why}; using {key}={used!r} for {shown}")


def _translate(values: Mapping[Any, Any], where: str) -> dict[str, Any]:
    """Fields kept, LMCache's names applied (see _LMCACHE_NAMES); anything else: ConfigError."""
    out: dict[str, Any] = {k: v for k, v in values.items() if k in _SPECS}
    _translate_values(out, where)
    for k, v in values.items():
        if k in _SPECS:
            continue
        entry = _LMCACHE_NAMES.get(k) if isinstance(k, str) else None
        if entry is None:
            raise _unknown_key(k, where)
        _apply_compat(k, entry, v, where, out)
    return out


def connector_overrides(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config overrides in vLLM's ``kv_connector_extra_config``, as LMCache's connector reads
    them: ``lmcache.<key>`` keys, plus the keys it reads without the prefix (``_CONNECTOR_KEYS``:
    mapped or warned about). Other keys are warned about once: a config key there without the
    prefix has no effect in LMCache either."""
    overrides: dict[str, Any] = {}
    bare: dict[str, Any] = {}
    for key, value in (extra or {}).items():
        if not isinstance(key, str):
            raise _unknown_key(key, "kv_connector_extra_config")
        if key.startswith(OVERRIDE_PREFIX):
            overrides[key] = value
        else:
            bare[key] = value
    out = _strip_override_prefix(overrides, "kv_connector_extra_config")
    for key, value in bare.items():
        entry = _CONNECTOR_KEYS.get(key)
        if entry is not None:
            _apply_compat(key, entry, value, "kv_connector_extra_config", out)
        elif key in _SPECS or key in _LMCACHE_NAMES:
            _warn_once(f"extra:{key}", (
                f"ignoring kv_connector_extra_config key '{key}': config keys need the "
                f"'{OVERRIDE_PREFIX}' prefix there (as in LMCache), e.g. '{OVERRIDE_PREFIX}{key}'"))
        else:
            _warn_once(f"extra:{key}", (
                f"ignoring kv_connector_extra_config key '{key}': neither LMCache's connector nor "
                f"this one reads it{_suggest(key, list(_CONNECTOR_KEYS))}"))
    return out


# ---------------------------------------------------------------------------------------
# Environment variable parsing
# ---------------------------------------------------------------------------------------
def _env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def _unquote(s: str) -> str:
    t = s.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    return s


def _parse_env(key: str, raw: str) -> Any:
    """Parse the text of ``LMCACHE_<KEY>`` by the field's type."""
    spec = _SPECS[key]
    var = _env_name(key)
    text = raw.strip()

    def fail(extra: str = "") -> ConfigError:
        return ConfigError(
            f"cannot parse environment variable {var}={raw!r}: expected {spec.describe()}"
            + (f" ({extra})" if extra else "")
        )

    if spec.optional and text.lower() in _NONE:
        return None
    kind = spec.kind
    if kind == "str":
        # Strings are kept as written (blend_special_str is " # # "), quotes removed.
        return _unquote(raw)
    if kind == "bool":
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise fail("one of true/false/1/0/yes/no/on/off")
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise fail() from None
    if kind == "float":
        try:
            return float(text)
        except ValueError:
            raise fail() from None
    if kind in ("list[int]", "list[float]"):
        conv = int if kind == "list[int]" else float
        if text.startswith("["):
            try:
                items = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise fail(str(e).splitlines()[0]) from None
            if not isinstance(items, list):
                raise fail()
        else:
            items = [p.strip() for p in text.split(",") if p.strip()]
        try:
            return [conv(x) if isinstance(x, str) else x for x in items]
        except ValueError:
            raise fail("comma-separated like 1,3 or a list like [1, 3]") from None
    if kind == "dict":
        try:
            value = yaml.safe_load(text)  # YAML is a superset of JSON
        except yaml.YAMLError as e:
            raise fail(str(e).splitlines()[0]) from None
        if not isinstance(value, dict):
            raise fail('a mapping like {"key": 1}')
        return value
    raise AssertionError(kind)  # pragma: no cover


def _env_values(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The config values set through ``LMCACHE_<FIELD>`` variables, parsed; LMCache's other
    variables (``_LMCACHE_NAMES``, ``_LMCACHE_ENV_ONLY``) mapped, warned about or refused."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    compat: list[tuple[str, _Compat, str]] = []
    field_vars = {_env_name(k): k for k in _SPECS}
    for var, raw in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        key = field_vars.get(var)
        if key is not None:
            values[key] = _parse_env(key, raw)
            continue
        if var in _NON_FIELD_ENV:
            continue
        entry = _LMCACHE_NAMES.get(var[len(ENV_PREFIX):].lower()) or _LMCACHE_ENV_ONLY.get(var)
        if entry is not None:
            compat.append((var, entry, raw))
        elif var not in _warned_env:
            _warned_env.add(var)
            match = difflib.get_close_matches(var[len(ENV_PREFIX):].lower(), list(_SPECS), n=1, cutoff=0.6)
            logger.warning(
                "ignoring unknown environment variable %s%s",
                var,
                f"; did you mean '{_env_name(match[0])}'?" if match else "",
            )
    _translate_values(values, "environment")
    for var, entry, raw in compat:  # after the fields, so an alias meets its target's value
        _apply_compat(var, entry, raw, "", values, parse_env=True)
    return values


# ---------------------------------------------------------------------------------------
# Files and overrides
# ---------------------------------------------------------------------------------------
def _read_yaml_mapping(path: str | os.PathLike) -> dict[str, Any]:
    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {p!r}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse config file {p!r} as YAML: {e}") from e
    if data is None:  # empty file
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {p!r} must hold a YAML mapping of config keys, "
            f"got {type(data).__name__}"
        )
    return _translate(data, f"config file {p!r}")


def _strip_override_prefix(overrides: Mapping[str, Any], where: str = "overrides") -> dict[str, Any]:
    """Accept ``{"chunk_size": 256}`` and ``{"lmcache.chunk_size": 256}`` alike; LMCache's other
    names (``_LMCACHE_NAMES``) are applied."""
    out: dict[str, Any] = {}
    for raw_key, value in overrides.items():
        if not isinstance(raw_key, str):
            raise _unknown_key(raw_key, where)
        key = raw_key[len(OVERRIDE_PREFIX):] if raw_key.startswith(OVERRIDE_PREFIX) else raw_key
        if key not in _SPECS and key not in _LMCACHE_NAMES:
            raise _unknown_key(raw_key, where, bare=key)
        if key in out and out[key] != value:
            raise ConfigError(
                f"config key '{key}' is given twice in {where} with different values "
                f"({out[key]!r} and {value!r}, with and without the '{OVERRIDE_PREFIX}' prefix)"
            )
        out[key] = value
    return _translate(out, where)


def _check_keys(values: Mapping[str, Any], source: str) -> None:
    for k in values:
        if k not in _SPECS:
            raise _unknown_key(k, source)


def _redact_url(url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return parts._replace(netloc=f"{user}:***@{netloc}").geturl()


# ---------------------------------------------------------------------------------------
# The config
# ---------------------------------------------------------------------------------------
@dataclass
class LMCacheEngineConfig:
    """Configuration of an LMCache engine (field names and defaults as in LMCache).

    Constructors: ``LMCacheEngineConfig(...)`` / :meth:`from_defaults` (defaults plus
    keyword overrides), :meth:`from_dict`, :meth:`from_file` (a YAML mapping),
    :meth:`from_env` (``LMCACHE_<FIELD>`` variables) and :meth:`load`. Every one of
    them validates; an invalid value raises :class:`ConfigError` (a ``ValueError``)
    whose message names the key and the accepted values.

    Resolution order of :meth:`load` (later wins, key by key)::

        1. the defaults below
        2. the YAML file named by ``LMCACHE_CONFIG_FILE`` (if set)
        3. ``LMCACHE_<FIELD>`` environment variables (e.g. ``LMCACHE_CHUNK_SIZE=512``)
        4. ``overrides`` (vLLM's ``kv_connector_extra_config``; keys with or without
           the ``lmcache.`` prefix)

    Validation runs once on the merged result, so constraints spanning two keys
    (``enable_blending`` needs ``use_layerwise``) may be satisfied across sources.
    Unlike LMCache (whose docs say env vars are ignored when a file is set), a file
    and env vars combine here.

    Environment values are parsed by the field's type: bools accept
    true/false/1/0/yes/no/on/off, lists accept ``1,3`` or ``[1, 3]``, ``extra_config``
    is YAML/JSON, and ``none``/``null``/empty mean None for optional fields.
    ``LMCACHE_*`` variables that are not fields are ignored (unknown ones are logged
    once as a warning). :meth:`from_file`, :meth:`from_env` and :meth:`load` also take
    LMCache's other names (``_LMCACHE_NAMES``: mapped, or ignored with a warning, or refused);
    ``__init__``, :meth:`from_defaults` and :meth:`from_dict` take field names only.
    """

    # Tokens per chunk; a positive power of two.
    chunk_size: int = 256
    # CPU (pinned memory) tier.
    local_cpu: bool = True
    max_local_cpu_size: float = 5.0  # GB
    # Disk tier: a directory ("file:///path" or "/path"); needs max_local_disk_size > 0.
    local_disk: str | None = None
    max_local_disk_size: float = 0.0  # GB
    # Remote tier: lm://host:port, redis://host:port[/db], rediss://..., valkey://...
    remote_url: str | None = None
    remote_serde: str = "naive"  # "naive" | "lz4"
    # Not an LMCache field; kept out of repr() and redacted in summary()/to_dict(redact=True).
    remote_auth_token: str | None = field(default=None, repr=False)
    blocking_timeout_secs: float = 10.0
    # Layerwise pipelining and CacheBlend.
    use_layerwise: bool = False
    enable_blending: bool = False
    # LMCache stores None for these two and documents 0.15 and 1 as the effective defaults.
    blend_recompute_ratios: list[float] = field(default_factory=lambda: [0.15])
    blend_check_layers: list[int] = field(default_factory=lambda: [1])
    blend_min_tokens: int = 256
    blend_special_str: str = " # # "
    # What to store.
    save_decode_cache: bool = False
    # LMCache's current default is False (older releases had True); blending forces True.
    save_unfull_chunk: bool = False
    enable_async_loading: bool = False
    # Scheduler-side lookup RPC timeout.
    lookup_timeout_ms: int = 3000
    # Not an LMCache field: each process serving an engine exports lmcache_triton_* metrics on
    # http://0.0.0.0:(prometheus_port + rank)/metrics. None: no HTTP server (the metrics still join
    # vLLM's own /metrics when PROMETHEUS_MULTIPROC_DIR is set).
    prometheus_port: int | None = None
    # Not LMCache fields. The longest a lookup's reservation may hold chunks in the CPU tier: a load
    # normally follows within one scheduler step, and a lookup whose request was aborted, timed
    # out or never scheduled must not hold tier capacity for good (expired leases are counted).
    reservation_lease_secs: float = 30.0
    # The share of hits (0..1) that vLLM recomputes instead of loading, to compare the computed KV
    # with the stored chunk (a canary: a mismatch is counted, logged and the chunk removed).
    verify_hit_rate: float = 0.0
    # Keys carry a keyed digest of each request's cache_salt, never the salt. Set the same secret
    # on every instance that shares a store to make those digests unguessable too.
    namespace_secret: str | None = field(default=None, repr=False)
    extra_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> LMCacheEngineConfig:
        """Check (and normalize in place) every field; raise :class:`ConfigError`."""
        for key in _SPECS:
            setattr(self, key, _coerce(key, getattr(self, key)))

        cs = self.chunk_size
        if cs <= 0 or cs & (cs - 1):
            raise ConfigError(
                f"invalid value for 'chunk_size': must be a positive power of two "
                f"(e.g. 16, 64, 256, 512), got {cs!r}"
            )
        for key in ("max_local_cpu_size", "max_local_disk_size", "blend_min_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(
                    f"invalid value for '{key}': must be >= 0, got {getattr(self, key)!r}"
                )
        if not 0.0 <= self.verify_hit_rate <= 1.0:
            raise ConfigError(
                f"invalid value for 'verify_hit_rate': must be in [0, 1], got {self.verify_hit_rate!r}"
            )
        for key in ("blocking_timeout_secs", "lookup_timeout_ms", "reservation_lease_secs"):
            if getattr(self, key) <= 0:
                raise ConfigError(
                    f"invalid value for '{key}': must be > 0, got {getattr(self, key)!r}"
                )

        if self.prometheus_port is not None and not 1 <= self.prometheus_port <= 65535:
            raise ConfigError(
                f"invalid value for 'prometheus_port': must be a TCP port in 1..65535 or None, "
                f"got {self.prometheus_port!r}"
            )

        self.local_disk = self._normalize_local_disk(self.local_disk)
        if self.local_disk is not None and self.max_local_disk_size <= 0:
            raise ConfigError(
                f"'local_disk' is set ({self.local_disk!r}) but 'max_local_disk_size' is "
                f"{self.max_local_disk_size!r}: set max_local_disk_size to a size in GB > 0, "
                f"or unset local_disk"
            )

        if self.remote_url is not None:
            self._check_remote_url(self.remote_url)
        if self.remote_serde not in REMOTE_SERDES:
            hint = (" (LMCache's lossy cachegen codec is not implemented here)"
                    if self.remote_serde == "cachegen" else "")
            raise ConfigError(
                f"invalid value for 'remote_serde': must be one of "
                f"{', '.join(map(repr, REMOTE_SERDES))}, got {self.remote_serde!r}{hint}"
            )

        if not self.blend_recompute_ratios:
            raise ConfigError(
                "invalid value for 'blend_recompute_ratios': "
                "must be a non-empty list of floats in [0, 1]"
            )
        for r in self.blend_recompute_ratios:
            if not 0.0 <= r <= 1.0:
                raise ConfigError(
                    f"invalid value for 'blend_recompute_ratios': each ratio must be in [0, 1], "
                    f"got {self.blend_recompute_ratios!r}"
                )
        if not self.blend_check_layers:
            raise ConfigError(
                "invalid value for 'blend_check_layers': "
                "must be a non-empty list of layer indices >= 0"
            )
        if any(layer < 0 for layer in self.blend_check_layers):
            raise ConfigError(
                f"invalid value for 'blend_check_layers': each layer index must be >= 0, "
                f"got {self.blend_check_layers!r}"
            )
        if self.enable_blending:
            if not self.use_layerwise:
                raise ConfigError(
                    "'enable_blending' = True requires 'use_layerwise' = True "
                    "(CacheBlend recomputes layer by layer; LMCache too blends only on its "
                    "layerwise path): add use_layerwise: true (LMCACHE_USE_LAYERWISE=true)"
                )
            if not self.save_unfull_chunk:
                # As LMCache does: blending needs the last, partial chunk of each segment.
                logger.warning("setting save_unfull_chunk=True because enable_blending=True")
                self.save_unfull_chunk = True
        return self

    @staticmethod
    def _normalize_local_disk(value: str | None) -> str | None:
        if value is None:
            return None
        path = value
        if path.startswith("file://"):
            path = path[len("file://"):]
        elif "://" in path:
            raise ConfigError(
                f"invalid value for 'local_disk': must be a directory path or a "
                f"'file:///path' URL, got {value!r}"
            )
        if not path.strip():
            raise ConfigError(
                f"invalid value for 'local_disk': must be a non-empty directory path "
                f"('/path' or 'file:///path') or None, got {value!r}"
            )
        return path

    @staticmethod
    def _check_remote_url(url: str) -> None:
        accepted = (
            "lm://host:port, redis://host:port[/db], rediss://host:port[/db], "
            "valkey://host:port[/db]"
        )

        def bad(why: str) -> ConfigError:
            return ConfigError(
                f"invalid value for 'remote_url': {why}; accepted forms: {accepted}, got {url!r}"
            )

        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise bad(str(e)) from None
        if parts.scheme not in REMOTE_SCHEMES:
            raise bad(f"unsupported scheme {parts.scheme!r}" if parts.scheme else "no scheme")
        if not parts.hostname:
            raise bad("missing host")
        if parts.scheme == "lm":
            if port is None:
                raise bad("missing port")
            if parts.path not in ("", "/"):
                raise bad("lm:// URLs take no path")
        else:
            db = parts.path.strip("/")
            if db and not db.isdigit():
                raise bad(f"the database must be a number, got {db!r}")
        if parts.query or parts.fragment:
            raise bad("no query or fragment allowed")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_defaults(cls, **overrides: Any) -> LMCacheEngineConfig:
        """The defaults, with ``overrides`` (field names) applied; validated."""
        _check_keys(overrides, "overrides")
        return cls(**overrides)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LMCacheEngineConfig:
        """Defaults plus a mapping of field names (e.g. the output of :meth:`to_dict`)."""
        return cls.from_defaults(**dict(values))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> LMCacheEngineConfig:
        """Defaults plus the keys of the YAML mapping at ``path``."""
        return cls(**_read_yaml_mapping(path))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LMCacheEngineConfig:
        """Defaults plus ``LMCACHE_<FIELD>`` variables (of ``os.environ`` by default)."""
        return cls(**_env_values(environ))

    @classmethod
    def load(
        cls,
        overrides: Mapping[str, Any] | None = None,
        *,
        config_file: str | os.PathLike | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> LMCacheEngineConfig:
        """defaults < config file < ``LMCACHE_*`` env vars < ``overrides``.

        The file is ``config_file`` if given, else ``$LMCACHE_CONFIG_FILE`` if set and
        non-empty. ``overrides`` keys may carry the ``lmcache.`` prefix.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        path = config_file if config_file is not None else (env.get(CONFIG_FILE_ENV) or None)
        if path is not None:
            values.update(_read_yaml_mapping(path))
        values.update(_env_values(env))
        if overrides:
            values.update(_strip_override_prefix(overrides))
        return cls(**values)

    # ------------------------------------------------------------------ views
    def to_dict(self, redact: bool = False) -> dict[str, Any]:
        """All fields as a plain dict (lists/dicts copied); ``redact`` hides secrets."""
        d = {k: _copy(getattr(self, k)) for k in _SPECS}
        if redact:
            for secret in ("remote_auth_token", "namespace_secret"):
                if d[secret] is not None:
                    d[secret] = "***"
            if d["remote_url"] is not None:
                d["remote_url"] = _redact_url(d["remote_url"])
            if d["extra_config"]:
                d["extra_config"] = {
                    k: "***" if any(w in k.lower() for w in _SECRET_WORDS) else v
                    for k, v in d["extra_config"].items()
                }
        return d

    def replace(self, **changes: Any) -> LMCacheEngineConfig:
        """A validated copy with ``changes`` applied."""
        _check_keys(changes, "replace()")
        values = self.to_dict()
        values.update(changes)
        return type(self)(**values)

    def summary(self) -> str:
        """A compact one-line description for log lines (secrets redacted)."""
        d = self.to_dict(redact=True)
        defaults = _defaults()
        parts = [f"chunk_size={d['chunk_size']}"]
        parts.append(f"cpu={d['max_local_cpu_size']:g}GB" if d["local_cpu"] else "cpu=off")
        if d["local_disk"]:
            parts.append(f"disk={d['local_disk']}({d['max_local_disk_size']:g}GB)")
        else:
            parts.append("disk=off")
        if d["remote_url"]:
            parts.append(f"remote={d['remote_url']}({d['remote_serde']})")
        else:
            parts.append("remote=off")
        shown = {"chunk_size", "local_cpu", "max_local_cpu_size", "local_disk",
                 "max_local_disk_size", "remote_url", "remote_serde"}
        for k, v in d.items():
            if k not in shown and v != defaults[k]:
                parts.append(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}")
        return "LMCacheEngineConfig(" + " ".join(parts) + ")"

    def __str__(self) -> str:
        return self.summary()

    def get_extra_config_value(self, key: str, default: Any = None) -> Any:
        """``extra_config[key]``, or ``default`` (LMCache has the same helper)."""
        return (self.extra_config or {}).get(key, default)


def _copy(v: Any) -> Any:
    return copy.deepcopy(v) if isinstance(v, (list, dict)) else v


def _defaults() -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(LMCacheEngineConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        else:
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out
