"""A replica's KV capacity asked of its engine (docs/DESIGN.md, "The proxy", "Engine facts"):
vLLM's ``/metrics`` (an excerpt of a real vLLM CPU engine's answer, started with
``--block-size 32 --num-gpu-blocks-override 97``), SGLang's ``/get_server_info``, and answers
that state nothing, lie or never come, served by a real HTTP server on loopback; and the
fleet's ``kv_capacity_tokens`` shapes (``"auto"``, an int, ``null``) through the proxy."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from proxy_testing import closed_port_url
from service_testing import wait_for
from support.asgi_server import serve_in_thread

from contextpilot_integrations.service.app import create_app
from contextpilot_integrations.service.proxy.fleet_config import FleetConfig
from contextpilot_integrations.service.proxy.kv_capacity import (
    MAX_ANSWER_BYTES,
    capacity_from_sglang_server_info,
    capacity_from_vllm_metrics,
    learn_kv_capacity,
)
from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
from contextpilot_integrations.service.service_config import ServiceConfig

VLLM_METRICS = (
    "# HELP python_info Python platform information\n"
    "# TYPE python_info gauge\n"
    'python_info{implementation="CPython",major="3",minor="11",patchlevel="7",version="3.'
    '11.7"} 1.0\n'
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="tmpxoxgyp9n"} 0.0\n'
    "# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleepin"
    "g; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; disca"
    "rd_all = 1 means sleep level 2.\n"
    "# TYPE vllm:engine_sleep_state gauge\n"
    'vllm:engine_sleep_state{engine="0",model_name="tmpxoxgyp9n",sleep_state="awake"} 1.0'
    "\n"
    'vllm:engine_sleep_state{engine="0",model_name="tmpxoxgyp9n",sleep_state="weights_off'
    'loaded"} 0.0\n'
    'vllm:engine_sleep_state{engine="0",model_name="tmpxoxgyp9n",sleep_state="discard_all'
    '"} 0.0\n'
    "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    'vllm:kv_cache_usage_perc{engine="0",model_name="tmpxoxgyp9n"} 0.0\n'
    "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of q"
    "ueried tokens.\n"
    "# TYPE vllm:prefix_cache_queries_total counter\n"
    'vllm:prefix_cache_queries_total{engine="0",model_name="tmpxoxgyp9n"} 0.0\n'
    "# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of"
    " queried tokens.\n"
    "# TYPE vllm:prefix_cache_queries_created gauge\n"
    'vllm:prefix_cache_queries_created{engine="0",model_name="tmpxoxgyp9n"} 1.79640254549'
    "76163e+09\n"
    "# HELP vllm:request_prompt_tokens Number of prefill tokens processed.\n"
    "# TYPE vllm:request_prompt_tokens histogram\n"
    'vllm:request_prompt_tokens_bucket{engine="0",le="1.0",model_name="tmpxoxgyp9n"} 0.0\n'
    'vllm:request_prompt_tokens_bucket{engine="0",le="2.0",model_name="tmpxoxgyp9n"} 0.0\n'
    'vllm:request_prompt_tokens_bucket{engine="0",le="5.0",model_name="tmpxoxgyp9n"} 0.0\n'
    'vllm:request_prompt_tokens_bucket{engine="0",le="10.0",model_name="tmpxoxgyp9n"} 0.0'
    "\n"
    'vllm:request_prompt_tokens_bucket{engine="0",le="20.0",model_name="tmpxoxgyp9n"} 0.0'
    "\n"
    'vllm:request_prompt_tokens_bucket{engine="0",le="50.0",model_name="tmpxoxgyp9n"} 0.0'
    "\n"
    'vllm:request_prompt_tokens_bucket{engine="0",le="100.0",model_name="tmpxoxgyp9n"} 0.'
    "0\n"
    'vllm:request_prompt_tokens_bucket{engine="0",le="200.0",model_name="tmpxoxgyp9n"} 0.'
    "0\n"
    'vllm:request_prompt_tokens_bucket{engine="0",le="500.0",model_name="tmpxoxgyp9n"} 0.'
    "0\n"
    'vllm:request_prompt_tokens_bucket{engine="0",le="1000.0",model_name="tmpxoxgyp9n"} 0'
    ".0\n"
    'vllm:request_prompt_tokens_bucket{engine="0",le="2000.0",model_name="tmpxoxgyp9n"} 0'
    ".0\n"
    'vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="tmpxoxgyp9n"} 0.0'
    "\n"
    'vllm:request_prompt_tokens_count{engine="0",model_name="tmpxoxgyp9n"} 0.0\n'
    'vllm:request_prompt_tokens_sum{engine="0",model_name="tmpxoxgyp9n"} 0.0\n'
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{_block_size_resolved="True",block_size="32",cache_dtype="auto'
    '",cache_hit_alignment_tokens="None",effective_attention_block_size="32",enable_mamba'
    '_shared_prefix_checkpoint="False",enable_prefix_caching="True",engine="0",gpu_memory'
    '_utilization="0.92",hash_block_size="None",is_attention_free="False",kv_cache_dtype_'
    'skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="1.515625",kv_cache'
    '_memory_bytes="1073741824",kv_cache_size_tokens="3104",kv_offloading_backend="native'
    '",kv_offloading_size="None",kv_sharing_fast_prefill="False",mamba_block_size="None",'
    'mamba_cache_dtype="auto",mamba_cache_mode="none",mamba_page_size_padded="None",mamba'
    '_ssm_cache_dtype="float32",num_cpu_blocks="None",num_gpu_blocks="97",num_gpu_blocks_'
    'override="97",prefix_cache_retention_interval="0",prefix_caching_hash_algo="sha256",'
    'prefix_match_unit="None",replayssm_buffer_len="16",skip_page_size_padded="None",slid'
    'ing_window="None",swa_bounded_replay="True",use_kda_recoverssm="False",use_replayssm'
    '="False",user_specified_block_size="True"} 1.0\n'
    "# HELP http_requests_total Total number of requests by method, status and handler.\n"
    "# TYPE http_requests_total counter\n"
)
REAL_CAPACITY = (97 - 1) * 32  # num_gpu_blocks less vLLM's null block, times block_size


def _with_labels(labels: str) -> str:
    return (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f"vllm:cache_config_info{{{labels}}} 1.0\n"
    )


def test_vllm_metrics_state_the_capacity() -> None:
    assert capacity_from_vllm_metrics(VLLM_METRICS) == REAL_CAPACITY
    # Two data-parallel engines of one replica: their caches add up.
    two = _with_labels('block_size="16",engine="0",num_gpu_blocks="11"').replace(
        "1.0\n",
        '1.0\nvllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="21"} 1.0\n',
    )
    assert capacity_from_vllm_metrics(two) == 10 * 16 + 20 * 16


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\x00{{{ not the exposition format",
        VLLM_METRICS.replace("vllm:cache_config_info", "vllm:other_info"),
        _with_labels('engine="0",num_gpu_blocks="97"'),  # no block_size
        _with_labels('block_size="32",engine="0"'),  # no num_gpu_blocks
        _with_labels('block_size="32",num_gpu_blocks="lots"'),
        _with_labels('block_size="32",num_gpu_blocks="-5"'),
        _with_labels('block_size="32",num_gpu_blocks="1e9"'),
        _with_labels('block_size="32",num_gpu_blocks="1"'),  # the null block only
        _with_labels('block_size="0",num_gpu_blocks="97"'),
        _with_labels('block_size="32",num_gpu_blocks="' + "9" * 400 + '"'),
        _with_labels('block_size="99999999",num_gpu_blocks="999999999999"'),  # past any cache
        _with_labels('block_size="32",num_gpu_blocks="97'),  # unterminated
    ],
    ids=["empty", "garbage", "absent", "no-block-size", "no-blocks", "non-numeric", "negative",
         "float", "null-block-only", "zero", "huge-digits", "huge-product", "unterminated"],
)  # fmt: skip
def test_vllm_metrics_that_state_no_sensible_capacity_leave_it_unknown(text: str) -> None:
    assert capacity_from_vllm_metrics(text) is None


def test_sglang_server_info_states_the_capacity() -> None:
    info = {"model_path": "m", "page_size": 1, "max_total_num_tokens": 20480, "version": "x"}
    assert capacity_from_sglang_server_info(json.dumps(info)) == 20480
    assert capacity_from_sglang_server_info(json.dumps({**info, "dp_size": 2})) == 40960


@pytest.mark.parametrize(
    "body",
    [
        b"", b"not json", b"[1, 2]", b"null", b'{"max_total_num_tokens": -1}',
        b'{"max_total_num_tokens": "20480"}', b'{"max_total_num_tokens": 2048.5}',
        b'{"max_total_num_tokens": true}', b'{"max_total_num_tokens": 1e300}',
        b'{"max_total_num_tokens": ' + b"9" * 400 + b"}",
        b'{"max_total_num_tokens": 20480, "dp_size": 0}', b'{"other": 1}',
        b"[" * 100_000 + b"]" * 100_000,
    ],
)  # fmt: skip
def test_sglang_answers_that_state_no_sensible_capacity_leave_it_unknown(body: bytes) -> None:
    assert capacity_from_sglang_server_info(body) is None


def _engines() -> FastAPI:
    """Engines under path prefixes: ``/NAME/metrics``, ``/NAME/get_server_info``."""
    app = FastAPI()
    app.state.tries = {}

    @app.get("/vllm/metrics")
    async def vllm() -> Response:
        return PlainTextResponse(VLLM_METRICS)

    @app.get("/sglang/get_server_info")
    async def sglang() -> Response:
        return JSONResponse({"max_total_num_tokens": 5000, "dp_size": 1})

    @app.get("/huge/{path:path}")
    async def huge(path: str) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(MAX_ANSWER_BYTES // 65_536 + 4):
                yield b"# " + b"x" * 65_533 + b"\n"

        return StreamingResponse(chunks(), media_type="text/plain")

    @app.get("/hang/metrics")
    async def hang() -> Response:
        await asyncio.sleep(1.5)  # past the try's timeout; the server ends soon after
        return PlainTextResponse("")

    @app.get("/starting/metrics")
    async def starting(request: Request) -> Response:
        tries = app.state.tries
        tries["starting"] = tries.get("starting", 0) + 1
        if tries["starting"] < 3:
            return PlainTextResponse("loading", status_code=503)
        return PlainTextResponse(VLLM_METRICS)

    @app.get("/hosted/{path:path}")
    async def hosted(path: str) -> Response:
        return JSONResponse({"error": {"message": "invalid api key"}}, status_code=401)

    return app


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[str, FastAPI]]:
    app = _engines()
    with serve_in_thread(app) as url:
        yield url, app


def _learn(base_url: str, **bounds: Any) -> tuple[int | None, float]:
    started = time.monotonic()
    found = asyncio.run(learn_kv_capacity(base_url, **bounds))
    return found, time.monotonic() - started


def test_the_capacity_is_asked_of_the_engine(engines: tuple[str, FastAPI]) -> None:
    url, app = engines
    assert _learn(f"{url}/vllm/v1")[0] == REAL_CAPACITY
    assert _learn(f"{url}/sglang")[0] == 5000
    # An engine still starting (a 5xx) is asked again until it answers.
    assert _learn(f"{url}/starting/v1", retry_s=0.01)[0] == REAL_CAPACITY
    assert app.state.tries["starting"] == 3


def test_an_engine_that_says_nothing_sensible_or_never_answers_leaves_it_unknown(
    engines: tuple[str, FastAPI], caplog: pytest.LogCaptureFixture
) -> None:
    url, _ = engines
    caplog.set_level(logging.INFO, logger="contextpilot_integrations.service.proxy.kv_capacity")
    for name in ("hosted", "huge", "nothing"):
        caplog.clear()
        found, took = _learn(f"{url}/{name}/v1")
        assert found is None and took < 5, (name, took)
        assert len(caplog.records) == 1, (name, [r.message for r in caplog.records])
        assert "KV capacity" in caplog.records[0].message
    # A hang and a refusal: each try bounded, the whole learning by its deadline, with one
    # warning.
    for base_url, bounds in [
        (f"{url}/hang/v1", {"timeout_s": 0.3, "retry_s": 0.01, "deadline_s": 1.0}),
        (f"{url}/hang/v1", {"timeout_s": 5.0, "retry_s": 0.01, "deadline_s": 0.5}),
        (closed_port_url(), {"retry_s": 0.01, "deadline_s": 0.3}),
    ]:
        caplog.clear()
        found, took = _learn(base_url, **bounds)
        assert found is None and took < bounds["deadline_s"] + 0.5, (bounds, took)
        assert [r.levelname for r in caplog.records] == ["WARNING"]
        assert f"within {bounds['deadline_s']:g} s" in caplog.records[0].message


def test_the_fleet_learns_gives_or_leaves_each_replica_capacity(
    engines: tuple[str, FastAPI],
) -> None:
    url, _ = engines
    fleet = {
        "mode": "gateway",
        "replicas": [
            {"name": "auto", "base_url": f"{url}/vllm/v1"},
            {"name": "said", "base_url": f"{url}/sglang/v1", "kv_capacity_tokens": "auto"},
            {"name": "given", "base_url": f"{url}/hosted/v1", "kv_capacity_tokens": 1234},
            {"name": "off", "base_url": f"{url}/starting/v1", "kv_capacity_tokens": None},
            {"name": "silent", "base_url": f"{url}/hosted2/v1"},
        ],
    }
    config = FleetConfig.from_mapping(fleet)
    assert config.learn_kv_capacity == {"auto", "said", "silent"}
    app = create_app(ServiceConfig(proxy=ProxyConfig(f"{url}/gateway/v1", fleet=fleet)))

    def capacities() -> dict[str, Any]:
        replicas = app.state.proxy.routing.stats()[""]["replicas"]
        return {
            name: (replica["kv_budget"] or {}).get("capacity_tokens")
            for name, replica in replicas.items()
        }

    assert capacities() == {"auto": None, "said": None, "given": 1234, "off": None,
                            "silent": None}  # fmt: skip
    with serve_in_thread(app, lifespan="on"):
        want = {"auto": REAL_CAPACITY, "said": 5000, "given": 1234, "off": None, "silent": None}
        wait_for(lambda: capacities() == want, 10.0, "the capacities learnt")


@pytest.mark.parametrize(
    "capacity",
    ["big", "AUTO", 0, -3, 2.5, True, [], float("nan"), 99999999999999999999999, 10**12 + 1],
)
def test_a_bad_capacity_is_refused_by_name(capacity: Any) -> None:
    replica = {"name": "a", "base_url": "http://127.0.0.1:9/v1", "kv_capacity_tokens": capacity}
    with pytest.raises(ValueError) as refused:
        FleetConfig.from_mapping({"replicas": [replica]})
    assert str(refused.value).startswith(
        "fleet.replicas[0].kv_capacity_tokens must be an int > 0 (at most 1000000000000 "
        'tokens), "auto" or null, got '
    )


def test_auto_on_a_replica_without_base_url_is_refused_the_default_not_asked() -> None:
    with pytest.raises(ValueError, match=r'replicas\[1\].kv_capacity_tokens "auto" .* no base_url'):
        FleetConfig.from_mapping(
            {"replicas": [{"name": "a"}, {"name": "b", "kv_capacity_tokens": "auto"}]}
        )
    config = FleetConfig.from_mapping({"replicas": [{"name": "a"}, {"name": "b"}]})
    assert config.learn_kv_capacity == frozenset()
    assert (
        FleetConfig.from_mapping({"replicas": [{"name": "a", "kv_capacity_tokens": 10**12}]})
        .router.replicas[0]
        .kv_capacity_tokens
        == 10**12
    )
