"""LMCache's configuration names, example configs and CI configs (tests/lmcache_configs/, copied
from LMCache, Apache-2.0), the vLLM connector's unprefixed keys, and `lmcache-triton config check`.
CPU only; no torch, no vLLM."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from lmcache_triton import config as config_mod, lmcache_compat
from lmcache_triton.config import ConfigError, LMCacheEngineConfig, connector_overrides

DATA = Path(__file__).parent / "lmcache_configs"

# Every key of LMCache's LMCacheEngineConfig (lmcache/v1/config.py: _CONFIG_DEFINITIONS, its
# _CONFIG_ALIASES and _DEPRECATED_CONFIGS), as of the version this table was written against.
LMCACHE_V1_NAMES = """
chunk_size local_cpu max_local_cpu_size local_cpu_use_hugepages reserve_local_cpu_size local_disk
local_disk_path_sharding max_local_disk_size remote_url remote_serde use_layerwise save_decode_cache
pre_caching_hash_algorithm enable_blending blend_recompute_ratios blend_thresholds blend_check_layers
blend_min_tokens blend_special_str retrieve_locations store_location enable_p2p p2p_host p2p_init_ports
p2p_lookup_ports mp_host mp_port enable_controller lmcache_instance_id controller_pull_url
controller_reply_url lmcache_worker_ports lmcache_worker_ids lmcache_worker_heartbeat_delay_time
lmcache_worker_heartbeat_time enable_pd pd_role pd_buffer_size pd_buffer_device pd_peer_host
pd_peer_init_port pd_peer_alloc_port pd_peer_query_port pd_proxy_host pd_proxy_port
pd_allocation_timeout_sec pd_shutdown_timeout_sec pd_condition_poll_interval_sec pd_max_prefill_len
pd_backend_mode pd_skip_proxy_notification pd_bidirectional transfer_channel nixl_backends
nixl_buffer_size nixl_buffer_device gds_path gds_path_sharding gds_buffer_size maru_path maru_pool_size
use_gds gds_backend audit_actual_remote_url internal_api_server_host extra_config save_unfull_chunk
blocking_timeout_secs external_lookup_client py_enable_gc cache_policy cost_aware_half_life_seconds
cost_aware_ewma_alpha numa_mode enable_async_loading internal_api_server_enabled
internal_api_server_port_start priority_limit internal_api_server_include_index_list
internal_api_server_socket_path_prefix runtime_plugin_locations storage_plugins remote_storage_plugins
lookup_timeout_ms min_retrieve_tokens hit_miss_ratio lookup_server_worker_ids
enable_scheduler_bypass_lookup script_allowed_imports enable_lazy_memory_allocator
lazy_memory_initial_ratio lazy_memory_expand_trigger_ratio lazy_memory_step_ratio lazy_memory_safe_size
enable_chunk_statistics chunk_statistics_auto_start_statistics chunk_statistics_auto_exit_timeout_hours
chunk_statistics_auto_exit_target_unique_chunks chunk_statistics_strategy enable_kv_events
use_gpu_connector_v3 pin_timeout_sec pin_check_interval_sec remote_config_url app_id
enable_hidden_state_cache max_hidden_state_cpu_size hidden_state_layers hidden_states_retrieve_mode
enable_xpyd nixl_peer_host nixl_peer_init_port nixl_peer_alloc_port nixl_proxy_host nixl_proxy_port
nixl_role controller_url lmcache_worker_port plugin_locations external_backends nixl_peer_port
""".split()


pytestmark = pytest.mark.usefixtures("clean_lmcache_env")


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "lmcache_triton" and r.levelno == logging.WARNING]


def load_file(caplog, name, **kw):
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        return LMCacheEngineConfig.load(config_file=DATA / name, environ=kw.pop("environ", {}), **kw)


# ------------------------------------------------------------------ the table


def test_every_lmcache_name_has_a_fate():
    """Each LMCache name is a field here, or in the table (alias / ignore / reject)."""
    table = lmcache_compat.LMCACHE_NAMES
    missing = [n for n in LMCACHE_V1_NAMES if n not in config_mod._FIELDS and n not in table]
    assert missing == []
    assert not set(table) & set(config_mod._FIELDS)
    for name, entry in table.items():
        assert entry.action in ("alias", "ignore", "reject"), name
        assert entry.reason, name
        if entry.action == "alias":
            assert entry.target in config_mod._FIELDS and entry.convert is not None, name
    for entry in lmcache_compat.CONNECTOR_KEYS.values():
        assert entry.action in ("alias", "ignore") and entry.reason


# ------------------------------------------------------------------ LMCache's published configs

PD_CHANNEL = "the PD transport here is pyzmq over TCP"
PD_PROXY = "the proxy needs no notification"
PD_DEVICE = "the PD receive buffer here is the receiver's CPU tier"
PD_OLD = "LMCache's older NIXL disaggregation names"
P2P = "peer-to-peer sharing"
CONTROLLER = "cache controller"


@pytest.mark.parametrize(
    "name, fields, warned",
    [
        ("blend_kv_v1_blending.yaml",
         dict(enable_blending=True, use_layerwise=True, local_cpu=True, max_local_cpu_size=5.0,
              blend_special_str=" # # ", save_unfull_chunk=True, blend_recompute_ratios=(0.15,)),
         {"save_unfull_chunk=True because enable_blending"}),
        ("disagg_1p1d_prefiller.yaml",
         dict(local_cpu=False, save_unfull_chunk=True, enable_pd=True, pd_role="sender", pd_buffer_size=1 << 30),
         {f"{PD_CHANNEL} (NIXL is not offered); ignoring transfer_channel", f"{PD_PROXY}; ignoring pd_proxy_host",
          f"{PD_PROXY}; ignoring pd_proxy_port", f"{PD_DEVICE} (pd_buffer_size sets its size); ignoring pd_buffer_device",
          f"{PD_OLD}", "ignoring nixl_backends"}),
        ("disagg_xpyd_decoder_1.yaml",  # a receiver's CPU tier is its receive buffer: 2 GB, whatever max_local_cpu_size
         dict(local_cpu=False, max_local_cpu_size=0.0, enable_pd=True, pd_role="receiver", pd_peer_host="localhost",
              pd_peer_init_port=(7300,), pd_buffer_size=2 << 30, cpu_tier_bytes=2 << 30, save_unfull_chunk=True),
         {"ignoring transfer_channel", "no separate allocation port; ignoring pd_peer_alloc_port",
          "ignoring pd_buffer_device"}),
        ("disagg_1p1d_decoder_nixl.yaml",  # the older nixl_* names; remote_serde: NULL is the default
         dict(local_cpu=False, max_local_cpu_size=0.0, max_local_disk_size=0.0, remote_serde="naive"),
         {f"{PD_OLD}: use enable_pd, pd_role, pd_peer_host, pd_peer_init_port; ignoring {k}"
          for k in ("enable_nixl", "nixl_role", "nixl_receiver_host", "nixl_receiver_port", "nixl_enable_gc",
                    "nixl_backends")}),
        ("ci_local_disk.yaml",
         dict(local_cpu=False, local_disk="/local/end-to-end-tests/local/", max_local_disk_size=5.0),
         set()),
        ("docs_redis_offload.yaml",
         dict(remote_url="redis://localhost:6379", remote_serde="naive", local_cpu=True), set()),
        ("docs_valkey.yaml",
         dict(remote_url="valkey://localhost:6379"),
         {"extra_config.valkey_password", "extra_config.valkey_username", "extra_config.valkey_database"}),
        ("v0_cpu_local.yaml", dict(local_cpu=True), {"local_device", "local_cpu=True"}),
        ("v0_example_lm.yaml", dict(local_cpu=True, remote_url="lm://localhost:65432"), {"local_device"}),
        ("v0_cpu_redis.yaml",
         dict(remote_url="redis://localhost:65432", remote_serde="lz4"),
         {"cachegen codec is not implemented here", "remote_serde='lz4'"}),
        ("p2p_sharing_example1.yaml",
         dict(enable_async_loading=True, extra_config={"lookup_backoff_time": 0.001}),
         {f"{P2P}", "ignoring p2p_init_ports", f"{CONTROLLER}", "ignoring controller_pull_url",
          "ignoring transfer_channel"}),
        ("cache_controller_example.yaml", dict(max_local_cpu_size=5.0),
         {"ignoring enable_controller", "ignoring controller_url", "ignoring lmcache_worker_port"}),
    ],
)
def test_lmcache_example_loads(caplog, name, fields, warned):
    c = load_file(caplog, name)
    for k, v in fields.items():
        assert getattr(c, k) == v, k
    got = warnings_of(caplog)
    for w in warned:
        assert any(w in m for m in got), (w, got)
    assert all("\n" not in m for m in got)  # one line each
    if not warned:
        assert got == []


def test_rag_blending_example_percentage_ratio(caplog):
    """benchmarks/rag/example_blending.yaml: `blend_recompute_ratio: 15  # default` (LMCache's
    default is the fraction 0.15), and no use_layerwise, which CacheBlend needs (here and in LMCache,
    whose connector blends only on its layerwise path, so LMCache silently does not blend): it loads
    with blending and layerwise on (one warning says so) and the ratio read as 15%; an explicit
    use_layerwise false is refused with a message that says why."""
    c = load_file(caplog, "rag_example_blending.yaml")
    assert c.enable_blending and c.use_layerwise and c.blend_recompute_ratios == (0.15,)
    assert c.max_local_cpu_size == 30.0 and c.blend_min_tokens == 256
    msgs = warnings_of(caplog)
    assert any("blend_recompute_ratio" in m and "percentage" in m for m in msgs)
    assert sum("use_layerwise=True" in m and "because enable_blending=True" in m for m in msgs) == 1
    lmcache_compat.reset_warnings()
    with pytest.raises(ConfigError, match="'use_layerwise' = False conflicts with 'enable_blending'"):
        load_file(caplog, "rag_example_blending.yaml", environ={"LMCACHE_USE_LAYERWISE": "false"})


@pytest.mark.parametrize(
    "name, pattern",
    [
        ("mooncakestore_backend_type.yaml", "remote_url.*unsupported scheme 'mooncakestore'"),
        ("v0_disk_local.yaml", "local_device.*local_disk.*max_local_disk_size"),
        # LMCache's RESP example: resp:// is served by the redis backend, but `async_loading` is a
        # key LMCache does not know either (it warns and drops it): an error here, with a hint.
        ("resp.yaml", "unknown config key 'async_loading'.*did you mean 'enable_async_loading'"),
    ],
)
def test_lmcache_example_refused(caplog, name, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_file(caplog, name)


def test_resp_scheme_is_redis(caplog):
    data = yaml.safe_load((DATA / "resp.yaml").read_text())
    data["enable_async_loading"] = data.pop("async_loading")
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        c = LMCacheEngineConfig.load(environ={}, config_file=_write(data))
    assert c.remote_url == "redis://localhost:6379" and c.blocking_timeout_secs == 120.0
    assert c.to_dict(redact=True)["extra_config"]["password"] == "***"
    assert c.to_dict(redact=True)["extra_config"]["resp_num_threads"] == 8
    got = warnings_of(caplog)
    assert any("RESP" in m for m in got) and any("extra_config.password" in m for m in got)


def _write(data) -> str:
    import tempfile

    f = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    yaml.safe_dump(data, f)
    f.close()
    return f.name


# ------------------------------------------------------------------ LMCache's CI configs (env + vLLM args)


def ci_setup(name, docker="docker", vllm="vllm"):
    spec = yaml.safe_load((DATA / name).read_text())
    env = dict(e.split("=", 1) for e in spec[docker]["env"] if "=" in e)
    args = spec[vllm].get("args", [])
    ktc = json.loads(args[args.index("--kv-transfer-config") + 1]) if "--kv-transfer-config" in args else {}
    return env, ktc.get("kv_connector_extra_config", {})


def load_ci(caplog, name, extra_env=None, **kw):
    env, extra = ci_setup(name, **kw)
    env = {**env, **(extra_env or {})}
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        return LMCacheEngineConfig.load(connector_overrides(extra), environ=env)


def test_ci_local_cpu(caplog):
    c = load_ci(caplog, "ci_local_cpu.yaml")
    assert (c.chunk_size, c.local_cpu, c.max_local_cpu_size) == (256, True, 5.0)
    assert warnings_of(caplog) == []


def test_ci_layerwise(caplog):
    c = load_ci(caplog, "ci_layerwise.yaml")
    assert c.use_layerwise and c.local_cpu and c.max_local_cpu_size == 5.0
    assert warnings_of(caplog) == []


def test_ci_async_disk(caplog):
    c = load_ci(caplog, "ci_async.yaml")
    assert c.local_cpu is False and c.max_local_cpu_size == 70.0
    assert c.local_disk == "/local/end-to-end-tests/local/" and c.max_local_disk_size == 70.0
    assert c.enable_async_loading and c.save_unfull_chunk is False
    assert c.extra_config == {"lookup_backoff_time": 0.01, "use_odirect": True}
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("side", ["prefiller", "decoder"])
def test_ci_pd_env_and_connector_keys_warned(caplog, side):
    if side == "decoder":  # LMCache's harness passes the ports on its command line, not in the environment
        with pytest.raises(ConfigError, match="'pd_role' = 'receiver' needs 'pd_peer_host'.*'pd_peer_init_port'"):
            load_ci(caplog, "ci_pd.yaml", docker=f"docker-{side}", vllm=f"vllm-{side}")
        caplog.clear()
        lmcache_compat.reset_warnings()
        c = load_ci(caplog, "ci_pd.yaml", docker=f"docker-{side}", vllm=f"vllm-{side}",
                    extra_env={"LMCACHE_PD_PEER_INIT_PORT": "7300"})
        assert (c.pd_role, c.pd_peer_host, c.pd_peer_init_port, c.cpu_tier_bytes) == ("receiver", "localhost",
                                                                                       (7300,), 2 << 30)
    else:
        c = load_ci(caplog, "ci_pd.yaml", docker=f"docker-{side}", vllm=f"vllm-{side}")
        assert c.pd_sender and c.pd_buffer_size == 1 << 30
    assert c.local_cpu is False and c.enable_pd and c.save_unfull_chunk
    got = warnings_of(caplog)
    for var, why in (("LMCACHE_TRANSFER_CHANNEL", PD_CHANNEL), ("LMCACHE_PD_BUFFER_DEVICE", PD_DEVICE)):
        assert any(m.startswith(why) and m.endswith(f"ignoring {var}") for m in got), (var, got)
    assert any("lmcache_rpc_port" in m and "engine_id" in m for m in got)
    assert any("skip_last_n_tokens" in m for m in got) == (side == "decoder")
    assert not any("discard_partial_chunks" in m for m in got)  # false: LMCache's default, no effect


# ------------------------------------------------------------------ names, one by one


def test_env_pd_variables_warned_once_not_errors(caplog):
    env = {"LMCACHE_ENABLE_PD": "True", "LMCACHE_PD_ROLE": "sender", "LMCACHE_PD_PROXY_PORT": "7500",
           "LMCACHE_CHUNK_SIZE": "512"}
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        c = LMCacheEngineConfig.load(environ=env)
        first = warnings_of(caplog)
        LMCacheEngineConfig.load(environ=env)
    assert c.chunk_size == 512
    assert c.pd_sender, "LMCache's PD names are fields here"
    assert len(first) == 1 and first[0].startswith("the PD sender here finishes each transfer") and \
        first[0].endswith("ignoring LMCACHE_PD_PROXY_PORT")
    assert warnings_of(caplog) == first  # once per name per process


def test_lmcache_defaults_pass_silently(caplog, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("enable_pd: false\npd_role: null\ncache_policy: lru\nenable_p2p: False\n"
                 "internal_api_server_port_start: 6999\nremote_config_url: null\nuse_gds: true\n")
    c = load_file(caplog, p)
    assert c == LMCacheEngineConfig()
    env = {"LMCACHE_ENABLE_PD": "false", "LMCACHE_CACHE_POLICY": "LRU", "LMCACHE_FORCE_SKIP_SAVE": ""}
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        LMCacheEngineConfig.load(environ=env)
    assert warnings_of(caplog) == []


def test_cache_policy_other_than_lru_warned(caplog, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("cache_policy: LFU\n")
    load_file(caplog, p)
    assert warnings_of(caplog) == [f"only LRU eviction is implemented here; ignoring cache_policy "
                                   f"(config file {str(p)!r})"]


@pytest.mark.parametrize(
    "value, expected",
    [(15, (0.15,)), (0.3, (0.3,)), (1, (1.0,)), (0, (0.0,)), ([0.1, 0.2], (0.1, 0.2)), (50.0, (0.5,))],
)
def test_blend_recompute_ratio_alias(caplog, value, expected):
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        c = LMCacheEngineConfig.load({"lmcache.blend_recompute_ratio": value}, environ={})
    assert c.blend_recompute_ratios == pytest.approx(expected)
    (msg,) = warnings_of(caplog)
    assert "blend_recompute_ratio" in msg and "blend_recompute_ratios" in msg
    assert ("percentage" in msg) == any(v > 1 for v in (value if isinstance(value, list) else [value]))


def test_blend_recompute_ratio_env_and_errors():
    c = LMCacheEngineConfig.load(environ={"LMCACHE_BLEND_RECOMPUTE_RATIO": "20"})
    assert c.blend_recompute_ratios == (0.2,)
    with pytest.raises(ConfigError, match="LMCACHE_BLEND_RECOMPUTE_RATIO='x'"):
        LMCacheEngineConfig.load(environ={"LMCACHE_BLEND_RECOMPUTE_RATIO": "x"})
    with pytest.raises(ConfigError, match="blend_recompute_ratio.*percentage in \\(1, 100\\]"):
        LMCacheEngineConfig.load({"blend_recompute_ratio": 150}, environ={})
    with pytest.raises(ConfigError, match="blend_recompute_ratio.*both given"):
        LMCacheEngineConfig.load({"blend_recompute_ratio": 0.3, "blend_recompute_ratios": [0.2]}, environ={})
    # the same value twice is fine
    c = LMCacheEngineConfig.load({"blend_recompute_ratio": 15, "blend_recompute_ratios": 0.15}, environ={})
    assert c.blend_recompute_ratios == (0.15,)


def test_pin_timeout_sec_is_pin_lease_secs(caplog):
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        c = LMCacheEngineConfig.load(environ={"LMCACHE_PIN_TIMEOUT_SEC": "300"})
    assert c.reservation_lease_secs == 300.0
    assert any("reservation_lease_secs=300.0" in m for m in warnings_of(caplog))


def test_remote_config_url_rejected():
    with pytest.raises(ConfigError, match="cannot honour remote_config_url.*remote service"):
        LMCacheEngineConfig.load({"lmcache.remote_config_url": "http://cfg:8000"}, environ={})


def test_unknown_names_stay_errors(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("chunk_sise: 256\n")
    with pytest.raises(ConfigError, match="'chunk_sise'.*did you mean 'chunk_size'"):
        LMCacheEngineConfig.from_file(p)
    with pytest.raises(ConfigError, match="unknown config key 'lmcache.nope'"):
        LMCacheEngineConfig.load({"lmcache.nope": 1}, environ={})


def test_unknown_env_still_only_warned(caplog):
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        LMCacheEngineConfig.load(environ={"LMCACHE_ZZZ": "1"})
    assert warnings_of(caplog) == ["ignoring unknown environment variable LMCACHE_ZZZ"]


def test_python_api_stays_strict():
    """from_defaults / from_dict take this project's field names only."""
    with pytest.raises(ConfigError, match="unknown config key 'enable_p2p'"):
        LMCacheEngineConfig.from_defaults(enable_p2p=True)
    with pytest.raises(ConfigError, match="cachegen codec is not implemented"):
        LMCacheEngineConfig.from_defaults(remote_serde="cachegen")


def test_redact_extra_config_secrets():
    c = LMCacheEngineConfig.from_defaults(extra_config={"valkey_password": "pw", "api_token": "t",
                                                        "valkey_database": 0})
    assert c.to_dict(redact=True)["extra_config"] == {"valkey_password": "***", "api_token": "***",
                                                      "valkey_database": 0}
    assert c.to_dict()["extra_config"]["valkey_password"] == "pw"


# ------------------------------------------------------------------ kv_connector_extra_config


def test_connector_keys(caplog):
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        out = connector_overrides({"lmcache.chunk_size": 512, "lmcache.enable_p2p": True,
                                   "discard_partial_chunks": True, "lmcache_rpc_port": "producer1",
                                   "skip_last_n_tokens": 1, "use_native": True, "max_local_cpu_size": 2,
                                   "something_else": 1})
    assert out == {"chunk_size": 512, "save_unfull_chunk": False}
    got = warnings_of(caplog)
    assert len(got) == 7, got
    expect = ["discard_partial_chunks (kv_connector_extra_config)", "save_unfull_chunk=False",
              "ignoring lmcache_rpc_port", "ignoring skip_last_n_tokens", "ignoring use_native",
              "peer-to-peer sharing between instances is not implemented here", "ignoring enable_p2p", "'max_local_cpu_size': config keys need the 'lmcache.' prefix",
              "'something_else': neither LMCache's connector nor this one reads it"]
    for e in expect:
        assert any(e in m for m in got), (e, got)


def test_connector_keys_defaults_silent(caplog):
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        out = connector_overrides({"discard_partial_chunks": False, "skip_last_n_tokens": 0,
                                   "lmcache_rpc_port": 0, "lmcache.save_unfull_chunk": True})
    assert out == {"save_unfull_chunk": True}
    assert warnings_of(caplog) == []


def test_connector_keys_errors():
    with pytest.raises(ConfigError, match="discard_partial_chunks.*expected bool"):
        connector_overrides({"discard_partial_chunks": "maybe"})
    with pytest.raises(ConfigError, match="both given"):
        connector_overrides({"discard_partial_chunks": True, "lmcache.save_unfull_chunk": True})
    with pytest.raises(ConfigError, match="unknown config key 'lmcache.chunk'"):
        connector_overrides({"lmcache.chunk": 1})


def test_resolve_config_stub_vllm(caplog, monkeypatch):
    from lmcache_triton.integration.vllm import common

    monkeypatch.setattr(common, "cpu_blocks_opaque", lambda: False)
    monkeypatch.setenv("LMCACHE_PD_PROXY_HOST", "localhost")
    monkeypatch.setenv("LMCACHE_SAVE_UNFULL_CHUNK", "true")
    extra = {"lmcache.chunk_size": 128, "lmcache.blend_recompute_ratio": 15,
             "discard_partial_chunks": True, "lmcache_rpc_port": "consumer1", "skip_last_n_tokens": 1}
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        c = common.resolve_config(vllm_config)
    assert c.chunk_size == 128 and c.blend_recompute_ratios == (0.15,)
    assert c.save_unfull_chunk is False  # discard_partial_chunks wins over the env, as in LMCache
    got = warnings_of(caplog)
    for e in ("discard_partial_chunks", "lmcache_rpc_port", "skip_last_n_tokens", "LMCACHE_PD_PROXY_HOST",
              "blend_recompute_ratio"):
        assert any(e in m for m in got), (e, got)
    # no extra config at all
    vllm_config.kv_transfer_config.kv_connector_extra_config = None
    assert common.resolve_config(vllm_config).chunk_size == 256


def test_resolve_config_amx_drops_partial_chunks_without_rewriting_blending(caplog, monkeypatch):
    """On AMX CPUs only whole blocks move: save_unfull_chunk is turned off by a new config (logged);
    a blending config is left as asked (the worker refuses CacheBlend there, with its own error)."""
    from lmcache_triton.integration.vllm import common

    monkeypatch.setattr(common, "cpu_blocks_opaque", lambda: True)
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector_extra_config={"lmcache.save_unfull_chunk": True}))
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        assert common.resolve_config(vllm_config).save_unfull_chunk is False
    assert any("AMX" in m for m in warnings_of(caplog))
    vllm_config.kv_transfer_config.kv_connector_extra_config = {
        "lmcache.enable_blending": True, "lmcache.use_layerwise": True}
    c = common.resolve_config(vllm_config)
    assert c.enable_blending and c.save_unfull_chunk is True


# ------------------------------------------------------------------ lmcache-triton config check


def test_cli_config_check_ok(capsys):
    from lmcache_triton.tools.cli import main

    assert main(["config", "check", str(DATA / "disagg_1p1d_prefiller.yaml")]) == 0
    out = capsys.readouterr().out
    body = out[out.index("{"):out.rindex("}") + 1]
    assert json.loads(body)["local_cpu"] is False
    warned = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 5 and all("PD" in w or "NIXL" in w for w in warned)
    assert "# loads: 5 warning(s)" in out
    # every warning again on a second check in the same process
    assert main(["config", "check", str(DATA / "disagg_1p1d_prefiller.yaml")]) == 0
    assert capsys.readouterr().out.count("warning: ") == 5


def test_cli_config_check_env_file_and_extra(capsys, monkeypatch):
    from lmcache_triton.tools.cli import main

    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(DATA / "docs_valkey.yaml"))
    monkeypatch.setenv("LMCACHE_REMOTE_AUTH_TOKEN", "s3cret")
    assert main(["config", "check", "--extra-config", '{"skip_last_n_tokens": 1}']) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and "Your password" not in out
    d = json.loads(out[out.index("{"):out.rindex("}") + 1])
    assert d["remote_auth_token"] == "***" and d["extra_config"]["valkey_password"] == "***"
    assert "docs_valkey.yaml" in out.splitlines()[0]
    assert "skip_last_n_tokens" in out


def test_cli_config_check_no_file(capsys):
    from lmcache_triton.tools.cli import main

    assert main(["config", "check"]) == 0
    out = capsys.readouterr().out
    assert "LMCACHE_CONFIG_FILE unset" in out and "# loads: 0 warning(s)" in out


def test_cli_config_check_lmcache_blending_example(capsys):
    """LMCache's benchmarks/rag/example_blending.yaml: blending and layerwise on, one warning about it."""
    from lmcache_triton.tools.cli import main

    assert main(["config", "check", str(DATA / "rag_example_blending.yaml")]) == 0
    captured = capsys.readouterr()
    loaded = json.loads(captured.out[captured.out.index("{"):captured.out.rindex("}") + 1])
    assert loaded["enable_blending"] is True and loaded["use_layerwise"] is True
    blending_warnings = [line for line in captured.out.splitlines() + captured.err.splitlines()
                         if line.startswith("warning:") and "because enable_blending=True" in line]
    assert len(blending_warnings) == 1 and "use_layerwise=True" in blending_warnings[0]


@pytest.mark.parametrize(
    "args, pattern",
    [
        ([str(DATA / "mooncakestore_backend_type.yaml")], "config error: invalid value for 'remote_url'"),
        (["/nonexistent/x.yaml"], "config error: cannot read config file"),
        (["--extra-config", "[1]"], "config error: --extra-config must be a JSON object"),
        (["--extra-config", "{bad"], "config error: "),
    ],
)
def test_cli_config_check_errors(capsys, args, pattern):
    from lmcache_triton.tools.cli import main

    assert main(["config", "check", *args]) == 2
    captured = capsys.readouterr()
    assert pattern in captured.err and captured.out == ""


def test_cli_config_check_imports_no_vllm_or_torch():
    code = ("import sys\nfrom lmcache_triton.tools.cli import main\n"
            f"rc = main(['config', 'check', {str(DATA / 'ci_local_disk.yaml')!r}])\n"
            "print('MODS', sorted(m for m in ('vllm', 'torch') if m in sys.modules), rc)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip().splitlines()[-1] == "MODS [] 0"
