"""Fast checks of the rollout pieces that need no model: parameters, bucketing, filtering, commands."""
from __future__ import annotations

import math

import pytest
import torch

from engine.config import RolloutConfig
from engine.rollout import SamplingParams, create_rollout_engine, iter_weight_buckets
from engine.rollout.sglang_cpu import CPU_STANDINS_DIR
from engine.rollout.torch_engine import keep_mask_top_k_top_p
from tests.rollout_support import requires_sglang


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_p", 1.5),
        ("top_p", 0.0),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("n", 0),
        ("top_k", 0),
        ("top_k", -2),
        ("max_new_tokens", 0),
        ("stop_token_ids", (-1,)),
    ],
)
def test_sampling_params_reject_bad_values_naming_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}={value!r}".replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(**{field: value})


def test_sampling_params_accept_the_edges():
    params = SamplingParams(temperature=0, top_p=1.0, top_k=-1, n=1, max_new_tokens=1, stop_token_ids=[3, 4])
    assert params.is_greedy and params.log_prob_temperature == 1.0
    assert params.stop_token_ids == (3, 4)
    assert SamplingParams(temperature=0.5, top_k=1).log_prob_temperature == 0.5


def test_buckets_respect_the_size_limit_and_never_mix_dtypes():
    tensors = [(f"w{i}", torch.zeros(256, dtype=torch.float32)) for i in range(10)]  # 1 KiB each
    tensors.insert(4, ("half", torch.zeros(8, dtype=torch.bfloat16)))
    tensors.append(("huge", torch.zeros(4096, dtype=torch.float32)))  # 16 KiB, over the limit
    buckets = list(iter_weight_buckets(iter(tensors), bucket_megabytes=3 / 1024))  # 3 KiB
    assert [name for bucket in buckets for name, _ in bucket] == [name for name, _ in tensors]
    for bucket in buckets:
        assert len({t.dtype for _, t in bucket}) == 1
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 3 * 1024 or len(bucket) == 1
    assert [len(b) for b in buckets] == [3, 1, 1, 3, 3, 1]


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="bucket_megabytes"):
        list(iter_weight_buckets([("w", torch.zeros(1))], 0))


def _keep_reference(probs: list[float], top_k: int, top_p: float) -> list[bool]:
    """SGLang's joint rule token by token: rank < top_k and mass of strictly higher ranks <= top_p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = [False] * len(probs)
    mass_above = 0.0
    for rank, index in enumerate(order):
        keep[index] = (top_k == -1 or rank < top_k) and mass_above <= top_p + 1e-12
        mass_above += probs[index]
    return keep


@pytest.mark.parametrize("top_k, top_p", [(-1, 0.5), (3, 1.0), (5, 0.8), (1, 0.3), (-1, 1.0)])
def test_top_k_top_p_mask_matches_a_per_token_reference(top_k, top_p):
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(6, 20, dtype=torch.float64) * 2, dim=-1)
    mask = keep_mask_top_k_top_p(probs, top_k, top_p)
    for row in range(probs.shape[0]):
        assert mask[row].tolist() == _keep_reference(probs[row].tolist(), top_k, top_p)
        assert mask[row].any()


def test_factory_rejects_unknown_engines_and_settings():
    with pytest.raises(ValueError, match="vllm"):
        create_rollout_engine(RolloutConfig(name="vllm"), "x")
    with pytest.raises(TypeError, match="'torch' rollout engine"):
        create_rollout_engine(RolloutConfig(name="torch"), "x", tensor_parallel=2)


def test_sglang_server_command_adds_cpu_flags_only_without_gpu(monkeypatch, tmp_path):
    from engine.rollout import sglang_server
    from engine.rollout.sglang_server import SGLangServer, SGLangServerConfig

    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    server = SGLangServer(SGLangServerConfig(model_path=str(tmp_path), log_path=tmp_path / "log",
                                             rollout=RolloutConfig(gpu_memory_utilization=0.7)))
    monkeypatch.setattr(sglang_server, "needs_cpu_adaptation", lambda: False)
    gpu_args, gpu_env = server.command()
    monkeypatch.setattr(sglang_server, "needs_cpu_adaptation", lambda: True)
    cpu_args, cpu_env = server.command()

    assert gpu_args[gpu_args.index("--mem-fraction-static") + 1] == "0.7"
    assert cpu_args.count("--mem-fraction-static") == 1 and "--max-total-tokens" in cpu_args
    for flag in ("--device", "--attention-backend", "--disable-overlap-schedule"):
        assert flag not in gpu_args and flag in cpu_args
    assert "SGLANG_USE_CPU_ENGINE" not in gpu_env
    assert cpu_env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert str(CPU_STANDINS_DIR) not in gpu_env.get("PYTHONPATH", "")
    assert cpu_env["PYTHONPATH"].split(":")[0] == str(CPU_STANDINS_DIR)


def test_sgl_kernel_stand_in_offers_nothing():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sgl_kernel_standin", CPU_STANDINS_DIR / "sgl_kernel" / "__init__.py")
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)
    assert standin.IS_TRIDENT_CPU_STANDIN
    with pytest.raises(NotImplementedError, match="stand-in"):
        standin.copy_all_layer_kv_cache_cpu()
    with pytest.raises(AttributeError):
        standin.__wrapped__
    # SGLang's AMX probe: no op registered, so it picks its plain-torch layers.
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")


def test_sglang_null_log_prob_is_a_named_error():
    # SGLang's JSON carries a NaN or infinite log-prob as null; a sample with one must not reach training.
    from engine.rollout.base import RolloutError
    from engine.rollout.sglang_engine import _parse_sample

    item = {"output_ids": [5, 6, 7], "meta_info": {"finish_reason": {"type": "length"},
                                                   "output_token_logprobs": [[-0.5, 5, None], [None, 6, None],
                                                                             [-1.0, 7, None]]}}
    with pytest.raises(RolloutError, match="non-finite log-prob .null. for output token 1 of 3"):
        _parse_sample(item, 2, None)
    item["meta_info"]["output_token_logprobs"][1][0] = -0.25
    assert _parse_sample(item, 2, None).log_probs == [-0.5, -0.25, -1.0]


def test_sglang_weight_version_spans_become_each_tokens_version():
    """SGLang's ``meta_info["weight_versions"]``: the version of each output token, where Trident
    named every span's weights (``set_weight_version``); the checkpoint's own ("default") is none."""
    from engine.rollout.base import RolloutError
    from engine.rollout.sglang_engine import _parse_sample

    item = {"output_ids": [5, 6, 7, 8], "meta_info": {
        "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, t, None] for t in (5, 6, 7, 8)],
        "weight_versions": [{"version": "3", "start": 0, "end": 3}, {"version": "4", "start": 3, "end": 4}]}}
    assert _parse_sample(item, 2, None).policy_versions == [3, 3, 3, 4]
    item["meta_info"]["weight_versions"][0]["version"] = "default"
    assert _parse_sample(item, 2, None).policy_versions is None
    item["meta_info"]["weight_versions"] = [{"version": "3", "start": 0, "end": 2}]
    with pytest.raises(RolloutError, match="cover 2 of 4 output tokens"):
        _parse_sample(item, 2, None)


@requires_sglang
@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_weight_version_spans_cover_the_output_in_every_order_the_overlap_scheduler_records(tokens):
    """Issue 45, defect 9 (``sglang_engine.py`` ``_token_versions`` requires spans covering exactly the
    output, only ever run with the overlap scheduler off). Under overlap a version change is recorded
    at ``len(req.output_ids)`` while the next token is in flight (``scheduler.py``
    ``update_weight_version``, ``utils/weight_versions.py`` ``record_weight_version_events``), so the
    boundary may fall one token early or at the very end, and one or two changes may land in one
    request; a finished request's spans are computed from ``output_ids_through_stop``, the list sent
    as ``output_ids`` (``output_streamer.py``). Run through SGLang's own span functions, every such
    order covers exactly the output and Trident takes it. (The routed-expert count is fixed the same
    way, ``seqlen - 1`` rows of ``origin_input_ids + output_ids_through_stop``: ``state_capturer/
    base.py`` ``get_topk``; it needs a GPU's capturer to run.)"""
    from sglang.srt.utils.weight_versions import (WeightVersionEvent, add_weight_versions_to_meta_info,
                                                  compute_weight_version_spans)

    from engine.rollout.sglang_engine import _parse_sample

    boundaries = [(), *[(b,) for b in range(1, tokens + 1)],
                  *[(a, b) for a in range(1, tokens + 1) for b in range(a, tokens + 1)]]
    for recorded in boundaries:
        versions = [str(3 + i) for i in range(len(recorded) + 1)]  # 3, then 4 (and 5) from each boundary on
        events = [WeightVersionEvent(old_version=old, num_output_tokens=at) for old, at in zip(versions, recorded)]
        meta = {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, t, None] for t in range(tokens)]}
        add_weight_versions_to_meta_info(meta, compute_weight_version_spans(events, versions[-1], tokens), tokens)
        sample = _parse_sample({"output_ids": list(range(tokens)), "meta_info": meta}, 2, None)
        expected = [int(versions[sum(at <= token for at in recorded)]) for token in range(tokens)]
        assert sample.policy_versions == expected, (recorded, meta["weight_versions"])


def test_an_abort_before_running_comes_without_routed_experts_and_is_kept():
    """SGLang answers a request aborted before it ran without ``routed_experts`` (scheduler.py
    ``send_abort_output``; with or without the overlap scheduler): the sample is kept, its experts
    unreported (the trainer's router decides, ``engine.roles.routing``); any other finish without
    them is still an error naming the server flag."""
    from engine.rollout.base import RolloutError
    from engine.rollout.sglang_engine import RoutedExpertsLayout, _parse_sample

    layout = RoutedExpertsLayout(num_layers=2, topk=2, moe_layers=(0, 1))
    aborted = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}, "output_token_logprobs": []}}
    sample = _parse_sample(aborted, 3, layout)
    assert sample.routed_experts is None and sample.finish_reason == "abort"
    stopped = {"output_ids": [5], "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, 5, None]]}}
    with pytest.raises(RolloutError, match="--enable-return-routed-experts"):
        _parse_sample(stopped, 3, layout)


def test_free_ports_are_drawn_below_the_ephemeral_range_and_ignore_the_seed():
    """Ports that the OS hands out to bind(0) and to outgoing connections (the ephemeral range) could
    be taken by any process before a server binds them; ranks seeded alike still draw apart."""
    import random

    from parallel.state import find_free_port

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = []
    for _ in range(8):
        random.seed(0)
        ports.append(find_free_port())
    assert all(20000 <= port < low for port in ports), ports
    assert len(set(ports)) > 1, ports


def test_an_external_server_address_that_refuses_connections_stops_the_wait(monkeypatch, tmp_path):
    """A ``server_addresses`` entry with nothing behind it fails within REFUSED_LIMIT_S (60 s; 1 s
    here), naming the address, instead of waiting out the 30-minute start-up timeout; a colocated
    peer's server (attached, not external) may refuse while it loads and is waited for."""
    import time

    from engine.rollout import RolloutError, sglang_server
    from engine.rollout.sglang_server import SGLangServer, SGLangServerConfig
    from parallel.state import find_free_port

    monkeypatch.setattr(sglang_server, "REFUSED_LIMIT_S", 1.0)
    port = find_free_port()  # nothing listens there

    def attached(external, startup_timeout_s):
        return SGLangServer.attach(SGLangServerConfig(
            model_path=str(tmp_path), log_path=tmp_path / "log", port=port,
            rollout=RolloutConfig(startup_timeout_s=startup_timeout_s)), external=external)

    started = time.monotonic()
    with pytest.raises(RolloutError, match=rf"nothing answers at SGLang server http://127.0.0.1:{port} .*server_addresses"):
        attached(True, 1800).wait_until_ready()
    assert time.monotonic() - started < 10
    with pytest.raises(RolloutError, match="was not ready after 4s"):
        attached(False, 4).wait_until_ready()


def test_sglang_vocab_padding_and_what_the_sharded_loader_covers():
    """SGLang pads vocab rows to a multiple of 64, or of 64 x TP where that does not split evenly
    (``VocabParallelEmbedding.__init__``); the sharded push covers a model whose key/value heads split
    over the generation TP and whose query groups Megatron does not pad."""
    import transformers

    from engine.models.hf_config import architecture_from_hf
    from engine.rollout.sglang_presharded import vocab_rows
    from engine.sync.weight_sync import presharded_refusal

    assert [vocab_rows(180, 2), vocab_rows(151936, 8), vocab_rows(128256, 8), vocab_rows(100, 3)] == [192, 151936, 128256, 192]
    llama = architecture_from_hf(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=64))
    assert presharded_refusal(llama, 2, 2) is None
    assert "2 key/value heads (of 8 query heads) do not split over rollout.tensor_model_parallel_size=4" in \
        presharded_refusal(llama, 2, 4)
    assert "Megatron pads the 2 query groups to 4" in presharded_refusal(llama, 4, 2)
    odd_mlp = architecture_from_hf(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=130, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=100, max_position_embeddings=64))
    assert "the MLP's 130 rows do not split over rollout.tensor_model_parallel_size=4" in presharded_refusal(odd_mlp, 2, 4)
