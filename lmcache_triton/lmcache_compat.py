"""LMCache's configuration names that are not fields here, and what becomes of each: mapped to a
field (an alias), ignored with a warning that says why, or refused. Also the values, remote_url
schemes and extra_config keys LMCache accepts and this project does not, the ``lmcache.`` prefix of
overrides, and the keys LMCache's vLLM connector reads from ``kv_connector_extra_config``
(:func:`connector_overrides`).

Its own module because it is a second vocabulary, LMCache's, beside the config's own declaration
(:mod:`lmcache_triton.config`): it changes when LMCache does, not when a field here does. Every
function takes the field table it translates into. Each name is warned about once per process
(:func:`warn_once`, :func:`reset_warnings`; the warn-once memory is here because most of the
config's warnings are about LMCache's names, and the other config modules share it). Standard
library and the config modules below it only; nothing happens at import.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lmcache_triton.config_fields import (
    FALSE_WORDS, NONE_WORDS, TRUE_WORDS, ConfigError, Field, is_number, suggest, unknown_key, unquote,
)
from lmcache_triton.remote_url import redact_url

__all__ = [
    "CONNECTOR_KEYS", "Compat", "LMCACHE_ENV_ONLY", "LMCACHE_NAMES", "OVERRIDE_PREFIX", "apply_compat",
    "connector_overrides", "reset_warnings", "strip_override_prefix", "translate", "translate_values",
    "warn_once", "why_refused",
]

logger = logging.getLogger("lmcache_triton")

OVERRIDE_PREFIX = "lmcache."

# Names already warned about in this process (warn once each): the LMCache names of LMCACHE_NAMES /
# CONNECTOR_KEYS that are mapped or ignored, unknown LMCACHE_* variables, the config's own notices.
_warned_env: set[str] = set()


# ---------------------------------------------------------------------------------------
# LMCache's other names: one table says what becomes of every configuration name LMCache
# 0.5.x accepts (lmcache/v1/config.py: _CONFIG_DEFINITIONS and _CONFIG_ALIASES, plus the
# older names its published examples still use) that is not a field of the config.
#
#   alias   the value sets `target` (converted where the unit differs), with a warning
#   ignore  a feature this project does not have: a warning says why, the value is dropped
#   reject  ConfigError: dropping it would silently run something else than asked for
#
# A name whose value equals LMCache's default (`default`) changes nothing and passes without a
# word, so a full LMCache config dump does not drown the warnings that matter. Names in neither
# the config's fields nor this table stay errors (files, overrides) or warnings (LMCACHE_* variables).
# ---------------------------------------------------------------------------------------
_ANY = object()  # no default: any value is acted on
_DROP = object()  # from an alias's convert: this value has no counterpart, ignore it (with the note)


@dataclass(frozen=True)
class Compat:
    """What becomes of one LMCache name (see the table's comment above)."""

    action: str  # "alias" | "ignore" | "reject"
    reason: str
    target: str | None = None  # alias only: the field it sets
    default: Any = _ANY  # LMCache's default: a value equal to it is accepted silently
    # alias only: (name, value) -> (value for target, or _DROP; a note for the warning)
    convert: Any = None


_PD_CHANNEL = "the PD transport here is pyzmq over TCP (NIXL is not offered)"
_PD_DEVICE = "the PD receive buffer here is the receiver's CPU tier (pd_buffer_size sets its size)"
_PD_ALLOC = ("a PD transfer here is one message per chunk to pd_peer_init_port (the receiver allocates as it "
             "receives): there is no separate allocation port")
_PD_PROXY = ("the PD sender here finishes each transfer before the prefill's reply, so the proxy needs no "
             "notification")
_PD_KNOB = "this LMCache PD tuning knob has no counterpart here"
_PD_OLD = "LMCache's older NIXL disaggregation names: use enable_pd, pd_role, pd_peer_host, pd_peer_init_port"
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
    if not items or not all(is_number(x) for x in items) or any(not 0 <= x <= 100 for x in items):
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
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS:
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


def _ignore(reason: str, default: Any = None) -> Compat:
    return Compat("ignore", reason, default=default)


LMCACHE_NAMES: dict[str, Compat] = {
    # Old or LMCache-only names of fields here.
    "blend_recompute_ratio": Compat("alias", "LMCache's old name of blend_recompute_ratios",
                                     target="blend_recompute_ratios", convert=_ratio_from_lmcache),
    "pin_timeout_sec": Compat("alias", "LMCache's forced-unpin timeout is reservation_lease_secs here",
                               target="reservation_lease_secs", convert=_same),
    # LMCache v0's config (lmcache/config.py), still in some of its published examples.
    "local_device": Compat("alias", "LMCache v0's name", target="local_cpu", convert=_local_device),
    "max_local_cache_size": Compat("alias", "LMCache v0's name of the CPU tier's size in GB",
                                    target="max_local_cpu_size", convert=_same),
    "blend_separator": Compat("alias", "LMCache v0's name of blend_special_str",
                               target="blend_special_str", convert=_same),
    "pipelined_backend": _ignore("LMCache v0's pipelined retrieve; see use_layerwise", False),
    "blend_add_special_in_precomp": _ignore("LMCache v0's CacheBlend option; not implemented here", False),
    # Honoured by behaviour: the tiers here evict least recently used chunks, as LMCache's default.
    "cache_policy": _ignore("only LRU eviction is implemented here", "LRU"),
    # Not safe to drop: the configuration asked for would never be applied.
    "remote_config_url": Compat("reject", "fetching configuration from a remote service is not "
                                 "supported here; put its settings in the config file", default=None),
    "app_id": _ignore("remote configuration (remote_config_url) is not supported here"),
    # Prefill/decode disaggregation: the names here that differ (enable_pd, pd_role, pd_peer_host,
    # pd_peer_init_port and pd_buffer_size are fields), and the older nixl_* / xpyd names.
    "transfer_channel": _ignore(_PD_CHANNEL, "zmq"),
    "pd_buffer_device": _ignore(_PD_DEVICE, "cpu"),
    "pd_peer_alloc_port": _ignore(_PD_ALLOC, None),
    "pd_proxy_host": _ignore(_PD_PROXY, None),
    "pd_proxy_port": _ignore(_PD_PROXY, None),
    "pd_skip_proxy_notification": _ignore(_PD_PROXY, False),
    **{k: _ignore(_PD_KNOB, d) for k, d in {
        "pd_peer_query_port": None, "pd_allocation_timeout_sec": float("inf"), "pd_shutdown_timeout_sec": 5.0,
        "pd_condition_poll_interval_sec": 0.005, "pd_max_prefill_len": 0, "pd_backend_mode": "async",
        "pd_bidirectional": False,
    }.items()},
    **{k: _ignore(_PD_OLD, d) for k, d in {
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

# LMCACHE_* variables LMCache reads elsewhere than in its config (the vLLM connector).
LMCACHE_ENV_ONLY: dict[str, Compat] = {
    "LMCACHE_FORCE_SKIP_SAVE": _ignore("forcing every save off is not implemented here", ""),
}

# kv_connector_extra_config keys LMCache's vLLM connector reads WITHOUT the `lmcache.` prefix
# (lmcache/integration/vllm/vllm_v1_adapter.py), and vLLM's wrapper of it.
CONNECTOR_KEYS: dict[str, Compat] = {
    # LMCache: partial chunks are discarded when this is true OR save_unfull_chunk is false.
    "discard_partial_chunks": Compat(
        "alias", "LMCache's connector discards partial chunks when it is true",
        target="save_unfull_chunk", default=False,
        convert=_discard_partial),
    "lmcache_rpc_port": _ignore(
        "not needed: lookup sockets here are named by vLLM's engine_id, unique per instance", 0),
    "skip_last_n_tokens": _ignore("LMCache's PD proxy appends the prefill's token to the decoder's prompt; "
                                  "`lmcache-triton proxy` sends the prompt unchanged, so no token is skipped "
                                  "at lookup", 0),
    "use_native": _ignore("it picks vLLM's copy of LMCache's connector, not this one", False),
}


def why_refused() -> dict[str, dict[Any, str]]:
    """field -> value LMCache accepts and a config built from field values refuses -> why (for
    :func:`~lmcache_triton.config_fields.build_fields`)."""
    return {name: {value: why for value, (_, why) in table.items()} for name, table in _LMCACHE_VALUES.items()}


def reset_warnings() -> None:
    """Forget which names were warned about, so the next load warns about each again."""
    _warned_env.clear()


def warn_once(name: str, message: str) -> None:
    """Log ``message`` as a warning, unless one about ``name`` was logged already (since
    :func:`reset_warnings`)."""
    if name not in _warned_env:
        _warned_env.add(name)
        logger.warning("%s", message)


def _matches_default(value: Any, default: Any) -> bool:
    """`value` (typed, or the text of an environment variable) equals LMCache's default."""
    if default is _ANY:
        return False
    if isinstance(value, str):
        text = unquote(value).strip()
        low = text.lower()
        if default is None:
            return low in NONE_WORDS
        if isinstance(default, bool):
            return low in (TRUE_WORDS if default else FALSE_WORDS)
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
    if is_number(value) and is_number(default):
        return float(value) == float(default)
    return False


def apply_compat(name: str, entry: Compat, value: Any, where: str, out: dict[str, Any],
                 fields: Mapping[str, Field], parse: Callable[[Field, str], Any] | None = None) -> None:
    """Act on one LMCache name (see LMCACHE_NAMES); an alias writes its target (one of `fields`)
    into `out`. `parse`: `value` is the text of the environment variable `name`, and `parse` reads
    such a text by a field's type."""
    shown = f"{name} ({where})" if where else name
    if _matches_default(value, entry.default):
        return  # LMCache's default: nothing to honour, drop or refuse
    if entry.action == "reject":
        raise ConfigError(f"cannot honour {shown}: {entry.reason}")
    if entry.action == "ignore":
        warn_once(name, f"{entry.reason}; ignoring {shown}")
        return
    target = entry.target
    assert entry.action == "alias" and target is not None
    if parse is not None:
        try:
            value = parse(fields[target], value)
        except ConfigError:
            raise ConfigError(
                f"cannot parse environment variable {name}={value!r}: "
                f"expected {fields[target].describe()}"
            ) from None
    converted, note = entry.convert(name, value)
    if converted is _DROP:
        warn_once(name, f"{shown}: {entry.reason}; ignoring it{note}")
        return
    if target in out:
        try:
            existing = fields[target].coerce(out[target])
        except ConfigError:
            existing = out[target]
        if existing != fields[target].coerce(converted):
            raise ConfigError(
                f"{shown} and '{target}' are both given, with different values "
                f"({value!r} and {out[target]!r}); keep '{target}' only"
            )
    out[target] = converted
    warn_once(name, f"{shown}: {entry.reason}; using {target}={converted!r}{note}")


def translate_values(values: dict[str, Any], where: str) -> None:
    """Replace (in place) the field values LMCache accepts and this project does not."""
    extra = values.get("extra_config")
    if isinstance(extra, Mapping):
        for k, hint in _LMCACHE_EXTRA_KEYS.items():
            if k in extra:
                warn_once(f"extra_config.{k}", f"extra_config.{k} ({where}) is not read here: {hint}")
    url = values.get("remote_url")
    if isinstance(url, str) and "://" in url:
        scheme, rest = url.split("://", 1)
        if scheme in _LMCACHE_SCHEMES:
            used, why = _LMCACHE_SCHEMES[scheme]
            values["remote_url"] = f"{used}://{rest}"
            warn_once(f"remote_url={scheme}", (
                f"{why}; using remote_url={redact_url(values['remote_url'])!r} "
                f"for {scheme}:// ({where})"))
    for key, table in _LMCACHE_VALUES.items():
        value = values.get(key, _ANY)
        if value is _ANY or not isinstance(value, (str, type(None))) or value not in table:
            continue
        used, why = table[value]
        values[key] = used
        if value is not None:
            shown = f"{key}={value!r}" + (f" ({where})" if where else "")
            warn_once(f"{key}={value}", f"{why}; using {key}={used!r} for {shown}")


def translate(values: Mapping[Any, Any], where: str, fields: Mapping[str, Field]) -> dict[str, Any]:
    """`fields` kept, LMCache's names applied (see LMCACHE_NAMES); anything else: ConfigError."""
    out: dict[str, Any] = {k: v for k, v in values.items() if k in fields}
    translate_values(out, where)
    for k, v in values.items():
        if k in fields:
            continue
        entry = LMCACHE_NAMES.get(k) if isinstance(k, str) else None
        if entry is None:
            raise unknown_key(k, fields, where)
        apply_compat(k, entry, v, where, out, fields)
    return out


def connector_overrides(extra: Mapping[str, Any] | None, fields: Mapping[str, Field]) -> dict[str, Any]:
    """The config overrides in vLLM's ``kv_connector_extra_config``, as LMCache's connector reads
    them: ``lmcache.<key>`` keys, plus the keys it reads without the prefix (``CONNECTOR_KEYS``:
    mapped or warned about). Other keys are warned about once: a config key there without the
    prefix has no effect in LMCache either."""
    overrides: dict[str, Any] = {}
    bare: dict[str, Any] = {}
    for key, value in (extra or {}).items():
        if not isinstance(key, str):
            raise unknown_key(key, fields, "kv_connector_extra_config")
        if key.startswith(OVERRIDE_PREFIX):
            overrides[key] = value
        else:
            bare[key] = value
    out = strip_override_prefix(overrides, fields, "kv_connector_extra_config")
    for key, value in bare.items():
        entry = CONNECTOR_KEYS.get(key)
        if entry is not None:
            apply_compat(key, entry, value, "kv_connector_extra_config", out, fields)
        elif key in fields or key in LMCACHE_NAMES:
            warn_once(f"extra:{key}", (
                f"ignoring kv_connector_extra_config key '{key}': config keys need the "
                f"'{OVERRIDE_PREFIX}' prefix there (as in LMCache), e.g. '{OVERRIDE_PREFIX}{key}'"))
        else:
            warn_once(f"extra:{key}", (
                f"ignoring kv_connector_extra_config key '{key}': neither LMCache's connector nor "
                f"this one reads it{suggest(key, list(CONNECTOR_KEYS))}"))
    return out


def strip_override_prefix(overrides: Mapping[str, Any], fields: Mapping[str, Field],
                          where: str = "overrides") -> dict[str, Any]:
    """Accept ``{"chunk_size": 256}`` and ``{"lmcache.chunk_size": 256}`` alike; LMCache's other
    names (``LMCACHE_NAMES``) are applied."""
    out: dict[str, Any] = {}
    for raw_key, value in overrides.items():
        if not isinstance(raw_key, str):
            raise unknown_key(raw_key, fields, where)
        key = raw_key[len(OVERRIDE_PREFIX):] if raw_key.startswith(OVERRIDE_PREFIX) else raw_key
        if key not in fields and key not in LMCACHE_NAMES:
            raise unknown_key(raw_key, fields, where, bare=key)
        if key in out and out[key] != value:
            raise ConfigError(
                f"config key '{key}' is given twice in {where} with different values "
                f"({_shown(fields, key, out[key])!r} and {_shown(fields, key, value)!r}, "
                f"with and without the '{OVERRIDE_PREFIX}' prefix)"
            )
        out[key] = value
    return translate(out, where, fields)


def _shown(fields: Mapping[str, Field], key: str, value: Any) -> Any:
    f = fields.get(key)
    return value if f is None else f.shown(value)

