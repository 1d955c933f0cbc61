"""Engine configuration: :class:`LMCacheEngineConfig`.

The field names, meanings and (where LMCache has them) defaults follow LMCache's
``lmcache/v1/config.py`` so that an LMCache YAML file or set of ``LMCACHE_*`` variables
works here unchanged for the options this package implements. LMCache's other names are
mapped, ignored with a warning that says why, or refused: see ``_LMCACHE_NAMES``.

Each field is declared once, in the class body: its annotation is its type, and :func:`option`
holds its default, its doc and the values it accepts. Coercion, the checks, the parsing of
``LMCACHE_*`` variables, redaction and the field reference (:func:`reference`, in the README) are
all derived from that declaration (``_FIELDS``). A config is frozen once built: change one with
:meth:`LMCacheEngineConfig.replace`, which returns a new, validated config.

This module imports only the standard library, PyYAML and the modules it is built from (the
lowest floor, as they are), and does nothing at import. The remote_url schemes and their
redaction are in :mod:`lmcache_triton.remote_url`, which storage/ reads too.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from lmcache_triton.config_fields import (
    FALSE_WORDS, NONE_WORDS, TRUE_WORDS, ConfigError, Field, build_fields, field_reference, is_number, option,
    suggest, thaw, unknown_key, unquote,
)
from lmcache_triton.remote_url import named_like_secret, redact_url, remote_url_forms, remote_url_problem

__all__ = [
    "ConfigError", "LMCacheEngineConfig", "ENV_PREFIX", "CONFIG_FILE_ENV",
    "connector_overrides", "option", "reference", "reset_warnings",
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

def _redact_secret_keys(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: "***" if isinstance(k, str) and named_like_secret(k) else v
            for k, v in mapping.items()}


def _power_of_two(value: int) -> str | None:
    if value <= 0 or value & (value - 1):
        return "must be a positive power of two (e.g. 16, 64, 256, 512)"
    return None


def _disk_path(value: str) -> str:
    """local_disk as a path: a ``file://`` URL is stored as its path (the same directory)."""
    path = value[len("file://"):] if value.startswith("file://") else value
    if "://" in path:
        raise ConfigError(f"invalid value for 'local_disk': must be a directory path or a "
                          f"'file:///path' URL, got {value!r}")
    if not path.strip():
        raise ConfigError(f"invalid value for 'local_disk': must be a non-empty directory path "
                          f"('/path' or 'file:///path') or None, got {value!r}")
    return path



# ---------------------------------------------------------------------------------------
# The config
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True, repr=False)
class LMCacheEngineConfig:
    """Configuration of an LMCache engine (field names and defaults as in LMCache).

    Constructors: ``LMCacheEngineConfig(...)`` / :meth:`from_defaults` (defaults plus
    keyword overrides), :meth:`from_dict`, :meth:`from_file` (a YAML mapping),
    :meth:`from_env` (``LMCACHE_<FIELD>`` variables) and :meth:`load`. Every one of
    them validates; an invalid value raises :class:`ConfigError` (a ``ValueError``)
    whose message names the key and the accepted values. The config they return is frozen
    (assigning a field raises ``dataclasses.FrozenInstanceError``; list fields are tuples and
    ``extra_config`` a read-only dict), hashable, and equal to another exactly when every
    field is: :meth:`replace` makes a changed, validated copy.

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

    Validation reports and never rewrites: a value is stored as given, or in a normal form of the
    same meaning (``2`` -> ``2.0`` for a float, ``[1, 3]`` -> ``(1, 3)``, ``0.15`` -> ``(0.15,)``
    for a list, ``file:///x`` -> ``/x``), or refused. The one value the config picks itself is
    that of ``save_unfull_chunk`` when it is not given (see its doc): that is logged.
    """

    chunk_size: int = option(256, "Tokens per chunk.", check=_power_of_two, accepted="a positive power of two")
    local_cpu: bool = option(True, "Keep chunks in the CPU tier (one pinned-memory pool).")
    max_local_cpu_size: float = option(5.0, "Size of the CPU tier, GB.", ge=0)
    local_disk: str | None = option(
        None, "Directory of the disk tier ('/path', or 'file:///path', stored as the path); needs "
        "max_local_disk_size > 0.", normalize=_disk_path)
    max_local_disk_size: float = option(0.0, "Size of the disk tier, GB.", ge=0)
    remote_url: str | None = option(
        None, "The remote tier: the cache server here (lm://), Redis / Valkey, or a Redis Cluster / "
        "Valkey cluster (several seed nodes). A password in it is "
        "redacted wherever the URL is shown.", check=remote_url_problem, accepted=remote_url_forms(),
        redact=redact_url)
    remote_serde: str = option("naive", "How chunks are encoded for the remote tier (lz4: lossless).",
                               choices=("naive", "lz4"))
    remote_auth_token: str | None = option(
        None, "The remote tier's token: the cache server's, or the Redis password when remote_url has "
        "none.", secret=True, ours=True)
    blocking_timeout_secs: float = option(10.0, "The longest one remote call may take, seconds.", gt=0)
    use_layerwise: bool = option(False, "Load and store layer by layer, pipelined with the forward pass.")
    enable_blending: bool = option(False, "CacheBlend: reuse chunks that are not a prefix; needs "
                                          "use_layerwise.")
    blend_recompute_ratios: tuple[float, ...] = option(
        (0.15,), "CacheBlend: the share of tokens recomputed after each check layer (LMCache stores "
        "None and documents 0.15).", ge=0, le=1, nonempty=True)
    blend_check_layers: tuple[int, ...] = option(
        (1,), "CacheBlend: the layers where the tokens to recompute are chosen (LMCache stores None "
        "and documents 1).", ge=0, nonempty=True)
    blend_min_tokens: int = option(256, "CacheBlend: the fewest tokens a segment needs to be cached "
                                        "on its own.", ge=0)
    blend_special_str: str = option(" # # ", "CacheBlend: the text that separates a prompt's segments.")
    save_decode_cache: bool = option(False, "Also store the KV of generated tokens.")
    enable_pd: bool = option(
        False, "Prefill/decode disaggregation: a sender (prefill instance) sends each prompt's chunks to "
        "the receiver (decode instance) that a request's kv_transfer_params.disagg_spec names; needs "
        "pd_role. Both sides save the prompt's partial last chunk (save_unfull_chunk defaults to true).")
    pd_role: str | None = option(None, "With enable_pd: 'sender' (the prefill instance, kv_role kv_producer) "
                                       "or 'receiver' (the decode instance, kv_role kv_consumer).",
                                 choices=("sender", "receiver"))
    pd_peer_host: str | None = option(
        None, "PD receiver: the address its transfer listener binds (one per worker rank).",
        check=lambda v: "must not be empty" if not v.strip() else None, accepted="a host name or address")
    pd_peer_init_port: tuple[int, ...] | None = option(
        None, "PD receiver: the TCP port of each worker rank's listener (one port per rank; a single "
        "port P means P + rank). The proxy tells the sender the same ports.", ge=1, le=65535, nonempty=True)
    pd_buffer_size: int | None = option(
        None, "PD receiver: bytes of received chunks it holds (its CPU tier's size; None: "
        "max_local_cpu_size). When full the least recently used unheld chunks make room.", gt=0)
    enable_offload_server: bool = option(
        False, "Each worker rank serves offload requests (store these slots under these chunk hashes) on an "
        "owner-only IPC socket; whoever reaches it decides what is stored under which hash.")
    save_unfull_chunk: bool | None = option(
        None, "Store the partial last chunk of a prompt. Not given (None): true with enable_blending "
        "(CacheBlend needs each segment's partial chunk; LMCache forces it too, logged), else false as "
        "in current LMCache. False with enable_blending is an error.")
    enable_async_loading: bool = option(False, "Lookups answer 'not yet' instead of waiting for every "
                                               "rank; vLLM asks again at a later step.")
    lookup_timeout_ms: int = option(3000, "Scheduler-side lookup RPC timeout, ms.", gt=0)
    prometheus_port: int | None = option(
        None, "Each process serving an engine exports its lmcache_triton metrics on "
        "http://0.0.0.0:(prometheus_port + rank)/metrics. None: no HTTP server (the metrics still join "
        "vLLM's own /metrics when PROMETHEUS_MULTIPROC_DIR is set).", ge=1, le=65535, ours=True)
    reservation_lease_secs: float = option(
        30.0, "The longest a lookup's reservation may hold chunks in the CPU tier: a load normally "
        "follows within one scheduler step; an aborted or unscheduled request must not hold tier "
        "capacity for good (expired leases are counted).", gt=0, ours=True)
    verify_hit_rate: float = option(
        0.0, "The share of hits that vLLM recomputes instead of loading, to compare the computed KV "
        "with the stored chunk (a canary: a mismatch is counted, logged and the chunk removed).",
        ge=0, le=1, ours=True)
    namespace_secret: str | None = option(
        None, "Keys carry a keyed digest of each request's cache_salt, never the salt; set the same "
        "secret on every instance that shares a store to make those digests unguessable too.",
        secret=True, ours=True)
    extra_config: dict[str, Any] | None = option(
        None, "Free-form settings, as LMCache's (stored read-only; see get_extra_config_value). Values "
        "of keys named like secrets (password, token...) are redacted.", redact=_redact_secret_keys)

    def __post_init__(self) -> None:
        # Types and normal forms (see the class doc), before the instance is handed out.
        for f in _FIELDS.values():
            object.__setattr__(self, f.name, f.coerce(getattr(self, f.name)))
        # The one field the config fills in itself, when not given; remembered so that replace()
        # resolves it anew rather than carrying the value picked here.
        unset = frozenset({"save_unfull_chunk"} if self.save_unfull_chunk is None else ())
        if unset:
            # PD: the decoder then loads all but the prompt's last token (LMCache's PD configs set it)
            object.__setattr__(self, "save_unfull_chunk", self.enable_blending or self.enable_pd)
        object.__setattr__(self, "_unset", unset)
        self.validate()
        if unset and self.enable_blending:
            _warn_once("save_unfull_chunk=auto", (
                "setting save_unfull_chunk=True because enable_blending=True (CacheBlend stores each "
                "segment's partial last chunk; LMCache does the same); set save_unfull_chunk: true "
                "to silence this"))

    # ------------------------------------------------------------------ validation
    def validate(self) -> LMCacheEngineConfig:
        """Check every field and the constraints between fields; raise :class:`ConfigError`.
        Changes nothing (the config is frozen); returns ``self``."""
        for f in _FIELDS.values():
            f.check(getattr(self, f.name))
        if self.local_disk is not None and self.max_local_disk_size <= 0:
            raise ConfigError(
                f"'local_disk' is set ({self.local_disk!r}) but 'max_local_disk_size' is "
                f"{self.max_local_disk_size!r}: set max_local_disk_size to a size in GB > 0, "
                f"or unset local_disk"
            )
        if self.enable_blending and not self.use_layerwise:
            raise ConfigError(
                "'enable_blending' = True requires 'use_layerwise' = True "
                "(CacheBlend recomputes layer by layer; LMCache too blends only on its "
                "layerwise path): add use_layerwise: true (LMCACHE_USE_LAYERWISE=true)"
            )
        if self.enable_pd:
            if self.pd_role is None:
                raise ConfigError("'enable_pd' = True needs 'pd_role': 'sender' (the prefill instance) or "
                                  "'receiver' (the decode instance)")
            if self.pd_role == "receiver" and (self.pd_peer_host is None or self.pd_peer_init_port is None):
                raise ConfigError(
                    "'pd_role' = 'receiver' needs 'pd_peer_host' (the address its listener binds) and "
                    "'pd_peer_init_port' (one port per worker rank, or a base port: base + rank)")
            if self.use_layerwise or self.enable_blending:
                raise ConfigError("'enable_pd' = True does not work with use_layerwise or enable_blending here: "
                                  "prefill/decode disaggregation moves whole chunks of a prefix")
        if self.enable_blending and not self.save_unfull_chunk:
            # Not turned on silently (LMCache does): false was asked for, and the config must either
            # be what was asked for or fail. Left unset, it is true with blending (__post_init__).
            raise ConfigError(
                "'save_unfull_chunk' = False conflicts with 'enable_blending' = True (CacheBlend "
                "stores each segment's partial last chunk): remove save_unfull_chunk (with "
                "blending it then defaults to true) or set it true, or turn enable_blending off; "
                "kv_connector_extra_config's discard_partial_chunks: true also means "
                "save_unfull_chunk=False"
            )
        return self

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

    def replace(self, **changes: Any) -> LMCacheEngineConfig:
        """A new, validated config with ``changes`` (field names) applied. A field this config
        filled in itself (``save_unfull_chunk`` not given) is resolved anew for the copy."""
        _check_keys(changes, "replace()")
        values = {name: getattr(self, name) for name in _FIELDS if name not in self._unset}
        values.update(changes)
        return type(self)(**values)

    # ------------------------------------------------------------------ views
    def to_dict(self, redact: bool = False) -> dict[str, Any]:
        """All fields as a plain dict of plain values (lists, dicts; copies); ``redact`` hides
        secrets: the secret fields, remote_url's password, extra_config keys named like secrets."""
        d = {name: thaw(getattr(self, name)) for name in _FIELDS}
        if redact:
            for name, f in _FIELDS.items():
                d[name] = f.shown(d[name])
        return d

    def summary(self) -> str:
        """A compact one-line description for log lines (secrets redacted)."""
        d = self.to_dict(redact=True)
        defaults = LMCacheEngineConfig().to_dict(redact=True)
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

    def __repr__(self) -> str:  # every field, secrets redacted (remote_url's password too)
        shown = ", ".join(f"{name}={f.shown(getattr(self, name))!r}" for name, f in _FIELDS.items())
        return f"{type(self).__name__}({shown})"

    @property
    def pd_receiver(self) -> bool:
        return self.enable_pd and self.pd_role == "receiver"

    @property
    def pd_sender(self) -> bool:
        return self.enable_pd and self.pd_role == "sender"

    @property
    def cpu_tier_bytes(self) -> int:
        """The CPU tier's size: a PD receiver's is its receive buffer, pd_buffer_size when given."""
        if self.pd_receiver and self.pd_buffer_size is not None:
            return self.pd_buffer_size
        return int(self.max_local_cpu_size * (1 << 30))

    def get_extra_config_value(self, key: str, default: Any = None) -> Any:
        """``extra_config[key]``, or ``default`` (LMCache has the same helper)."""
        return (self.extra_config or {}).get(key, default)


def _refuse_assignment(self: LMCacheEngineConfig, name: str, value: Any = None) -> None:
    raise dataclasses.FrozenInstanceError(
        f"cannot set or delete {name!r}: an LMCacheEngineConfig is frozen once built; "
        f"use config.replace({name}=...) for a new, validated config"
    )


# The dataclass's own refusal, with the way out in the message (its __init__ and __post_init__
# set fields through object.__setattr__, as frozen dataclasses do).
LMCacheEngineConfig.__setattr__ = _refuse_assignment  # type: ignore[method-assign,assignment]
LMCacheEngineConfig.__delattr__ = _refuse_assignment  # type: ignore[method-assign,assignment]



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
# _FIELDS nor this table stay errors (files, overrides) or warnings (LMCACHE_* variables).
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
    "skip_last_n_tokens": _ignore("LMCache's PD proxy appends the prefill's token to the decoder's prompt; "
                                  "`lmcache-triton proxy` sends the prompt unchanged, so no token is skipped "
                                  "at lookup", 0),
    "use_native": _ignore("it picks vLLM's copy of LMCache's connector, not this one", False),
}


# The field table, derived from the declaration above.
_FIELDS: dict[str, Field] = build_fields(
    LMCacheEngineConfig, {name: {value: why for value, (_, why) in table.items()} for name, table in _LMCACHE_VALUES.items()})


def reference() -> str:
    """The fields as a Markdown table (name, type, default, accepted values, doc): the README's."""
    return field_reference(_FIELDS)


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
                f"expected {_FIELDS[target].describe()}"
            ) from None
    converted, note = entry.convert(name, value)
    if converted is _DROP:
        _warn_once(name, f"{shown}: {entry.reason}; ignoring it{note}")
        return
    if target in out:
        try:
            existing = _FIELDS[target].coerce(out[target])
        except ConfigError:
            existing = out[target]
        if existing != _FIELDS[target].coerce(converted):
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
            _warn_once(f"{key}={value}", f"{why}; using {key}={used!r} for {shown}")


def _translate(values: Mapping[Any, Any], where: str) -> dict[str, Any]:
    """Fields kept, LMCache's names applied (see _LMCACHE_NAMES); anything else: ConfigError."""
    out: dict[str, Any] = {k: v for k, v in values.items() if k in _FIELDS}
    _translate_values(out, where)
    for k, v in values.items():
        if k in _FIELDS:
            continue
        entry = _LMCACHE_NAMES.get(k) if isinstance(k, str) else None
        if entry is None:
            raise unknown_key(k, _FIELDS, where)
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
            raise unknown_key(key, _FIELDS, "kv_connector_extra_config")
        if key.startswith(OVERRIDE_PREFIX):
            overrides[key] = value
        else:
            bare[key] = value
    out = _strip_override_prefix(overrides, "kv_connector_extra_config")
    for key, value in bare.items():
        entry = _CONNECTOR_KEYS.get(key)
        if entry is not None:
            _apply_compat(key, entry, value, "kv_connector_extra_config", out)
        elif key in _FIELDS or key in _LMCACHE_NAMES:
            _warn_once(f"extra:{key}", (
                f"ignoring kv_connector_extra_config key '{key}': config keys need the "
                f"'{OVERRIDE_PREFIX}' prefix there (as in LMCache), e.g. '{OVERRIDE_PREFIX}{key}'"))
        else:
            _warn_once(f"extra:{key}", (
                f"ignoring kv_connector_extra_config key '{key}': neither LMCache's connector nor "
                f"this one reads it{suggest(key, list(_CONNECTOR_KEYS))}"))
    return out


# ---------------------------------------------------------------------------------------
# Environment variable parsing
# ---------------------------------------------------------------------------------------
def _env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()



def _parse_env(key: str, raw: str) -> Any:
    """Parse the text of ``LMCACHE_<KEY>`` by the field's type."""
    f = _FIELDS[key]
    var = _env_name(key)
    text = raw.strip()

    def fail(extra: str = "") -> ConfigError:
        return ConfigError(
            f"cannot parse environment variable {var}={raw!r}: expected {f.describe()}"
            + (f" ({extra})" if extra else "")
        )

    if f.optional and text.lower() in NONE_WORDS:
        return None
    kind = f.kind
    if kind == "str":
        # Strings are kept as written (blend_special_str is " # # "), quotes removed.
        return unquote(raw)
    if kind == "bool":
        low = text.lower()
        if low in TRUE_WORDS:
            return True
        if low in FALSE_WORDS:
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
    field_vars = {_env_name(k): k for k in _FIELDS}
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
            match = difflib.get_close_matches(var[len(ENV_PREFIX):].lower(), list(_FIELDS), n=1, cutoff=0.6)
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
            raise unknown_key(raw_key, _FIELDS, where)
        key = raw_key[len(OVERRIDE_PREFIX):] if raw_key.startswith(OVERRIDE_PREFIX) else raw_key
        if key not in _FIELDS and key not in _LMCACHE_NAMES:
            raise unknown_key(raw_key, _FIELDS, where, bare=key)
        if key in out and out[key] != value:
            raise ConfigError(
                f"config key '{key}' is given twice in {where} with different values "
                f"({_shown(key, out[key])!r} and {_shown(key, value)!r}, "
                f"with and without the '{OVERRIDE_PREFIX}' prefix)"
            )
        out[key] = value
    return _translate(out, where)


def _shown(key: str, value: Any) -> Any:
    f = _FIELDS.get(key)
    return value if f is None else f.shown(value)


def _check_keys(values: Mapping[str, Any], source: str) -> None:
    for k in values:
        if k not in _FIELDS:
            raise unknown_key(k, _FIELDS, source)
