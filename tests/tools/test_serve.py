"""`lmcache-triton serve`'s plan: the arguments and environment it adds to vLLM's `serve`, only
where the user set nothing. The server itself, asked through the `openai` client, is
tests/e2e/test_openai_serve_e2e.py."""

from __future__ import annotations

import json

from lmcache_triton.tools.serve import DEFAULT_KV_TRANSFER_CONFIG, given_options, plan


def test_defaults_apply_only_where_the_user_set_nothing(tmp_path):
    argv, env = plan("M", ["--port", "8001"], cpu=True, environ={})
    assert argv[:3] == ["M", "--port", "8001"], "MODEL first, the user's arguments unchanged"
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == DEFAULT_KV_TRANSFER_CONFIG
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" in argv
    assert 1 <= int(env["VLLM_CPU_KVCACHE_SPACE"]) <= 4

    user = ["--kv_transfer_config.kv_connector", "X", "--enable-prefix-caching", "-O3",
            "--kv-cache-memory-bytes", "2G"]
    assert plan("M", user, cpu=True, environ={}) == (["M", *user], {}), "nothing of ours where the user chose"
    assert plan("M", [], cpu=True, environ={"VLLM_CPU_KVCACHE_SPACE": "2"})[1] == {}
    assert plan("M", ["--no-enforce-eager"], cpu=True, environ={})[0].count("--enforce-eager") == 0
    assert plan("M", ["-cc", '{"mode": 0}'], cpu=True, environ={})[0].count("--enforce-eager") == 0
    # CUDA vLLM: the connector and prefix caching only
    argv, env = plan("M", [], cpu=False, environ={})
    assert env == {} and "--enforce-eager" not in argv and "--no-enable-prefix-caching" in argv

    config = tmp_path / "serve.yaml"
    config.write_text("kv_transfer_config: {kv_connector: X, kv_role: kv_both}\nenable-prefix-caching: true\n")
    assert {"kv-transfer-config", "enable-prefix-caching", "config"} <= given_options(["--config", str(config)])
    assert "--kv-transfer-config" not in plan("M", ["--config", str(config)], cpu=False, environ={})[0]
