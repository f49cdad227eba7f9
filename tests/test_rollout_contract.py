"""The rollout contract, written once and run against every engine (embedded torch, the same in a
process of its own, real SGLang).

Every numerical check compares with an independent reference: one unpadded, uncached HF forward of
prompt + response in float64 (``tests/rollout_support.py``). The SGLang variant starts ONE real
server for the whole module (30-50 s on CPU).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.config import RolloutConfig
from engine.rollout import RolloutError, SamplingParams, WeightUpdateError, create_rollout_engine
from engine.rollout.torch_engine import keep_mask_top_k_top_p
from tests.rollout_support import (
    PROMPTS,
    SGLANG_MARKS,
    build_tiny_model,
    random_llama,
    reference_log_probs,
    SharedServer,
    teacher_forced_logits,
)

LOG_PROB_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module", params=["torch", "torch-process", pytest.param("sglang", marks=SGLANG_MARKS)])
def started_engine(request, tiny):
    """The torch engines start here; SGLang's is this pytest process's shared server."""
    if request.param == "sglang":
        yield request.getfixturevalue("shared_tiny_sglang")
        return
    rollout = create_rollout_engine(RolloutConfig(name=request.param, dtype="float32"), str(tiny.path),
                                    max_batch_size=8)
    yield rollout
    rollout.shutdown()


@pytest.fixture
def engine(started_engine, tiny):
    """The engine serving ``tiny``'s weights (the shared server's tiny Llama is built from the same
    seed: the same weights), pushed afresh for each test on the shared SGLang server."""
    if isinstance(started_engine, SharedServer):
        assert all(torch.equal(a, b) for a, b in zip(started_engine.tiny.model.state_dict().values(),
                                                       tiny.model.state_dict().values()))
        return started_engine.serve_tiny_weights()
    return started_engine


def assert_log_probs_match(model, prompt, sample, temperature):
    assert len(sample.log_probs) == len(sample.token_ids)
    expected = reference_log_probs(model, prompt, sample.token_ids, temperature)
    got = torch.tensor(sample.log_probs, dtype=torch.float64)
    assert torch.allclose(got, expected, atol=LOG_PROB_TOLERANCE, rtol=0), (got - expected).abs().max()


def assert_same_outputs(got, expected):
    """Same tokens and finish reasons; log-probs equal up to batching round-off (SGLang batches
    concurrent requests as they arrive, so the float32 reductions may differ in order)."""
    assert [[(s.token_ids, s.finish_reason) for s in samples] for samples in got] == [
        [(s.token_ids, s.finish_reason) for s in samples] for samples in expected
    ]
    for got_samples, expected_samples in zip(got, expected):
        for a, b in zip(got_samples, expected_samples):
            assert torch.allclose(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=LOG_PROB_TOLERANCE, rtol=0)


def test_greedy_tokens_and_log_probs_equal_hf(engine, tiny):
    # Prompts of different lengths in one batch: the torch engine left-pads them.
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(results) == len(PROMPTS)
    for prompt, (sample,) in zip(PROMPTS, results):
        assert sample.finish_reason == "length" and len(sample.token_ids) == 8
        argmax = teacher_forced_logits(tiny.model, prompt, sample.token_ids).argmax(dim=-1)
        assert sample.token_ids == argmax.tolist()
        assert_log_probs_match(tiny.model, prompt, sample, temperature=0.0)


def test_sampled_log_probs_are_temperature_scaled_before_top_k_top_p(engine, tiny):
    temperature, top_k, top_p = 0.7, 8, 0.9
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p, n=3, ignore_eos=True)
    results = engine.generate(PROMPTS[:2], params)
    largest_renormalisation_gap = 0.0
    for prompt, samples in zip(PROMPTS[:2], results):
        assert len(samples) == 3
        for sample in samples:
            assert_log_probs_match(tiny.model, prompt, sample, temperature)
            scaled = teacher_forced_logits(tiny.model, prompt, sample.token_ids) / temperature
            keep = keep_mask_top_k_top_p(torch.softmax(scaled, dim=-1), top_k, top_p)
            tokens = torch.tensor(sample.token_ids).view(-1, 1)
            assert keep.gather(1, tokens).all(), "a token outside the top-k/top-p set was sampled"
            # The log-prob after renormalising over the kept set would be larger: show the gap.
            renormalised = torch.log_softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1).gather(1, tokens).squeeze(1)
            gap = (renormalised - torch.tensor(sample.log_probs, dtype=torch.float64)).abs().max().item()
            largest_renormalisation_gap = max(largest_renormalisation_gap, gap)
    assert largest_renormalisation_gap > 1e-2


def test_n_samples_differ_and_keep_their_prompt_order(engine):
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0, n=4, ignore_eos=True))
    assert [len(samples) for samples in results] == [4] * len(PROMPTS)
    for samples in results:
        assert all(len(s.token_ids) == 6 and s.finish_reason == "length" for s in samples)
    distinct = {tuple(s.token_ids) for samples in results for s in samples}
    assert len(distinct) > len(PROMPTS), "n samples at temperature 1 should not all coincide"


def test_eos_and_stop_tokens_end_the_sequence(engine, tiny):
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    (eos_sample,), = engine.generate([tiny.eos_prompt], greedy)
    assert eos_sample.finish_reason == "stop"
    assert len(eos_sample.token_ids) == 3 and eos_sample.token_ids[-1] == tiny.model.config.eos_token_id
    assert_log_probs_match(tiny.model, tiny.eos_prompt, eos_sample, 0.0)

    ignoring = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    (full,), = engine.generate([tiny.eos_prompt], ignoring)
    assert full.finish_reason == "length" and len(full.token_ids) == 10

    (unstopped,), = engine.generate([PROMPTS[0]], ignoring)
    stop_id = unstopped.token_ids[1]
    (stopped,), = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(stop_id,)))
    # The first token that is the stop id or EOS ends the sequence and is kept.
    end = next(i for i, t in enumerate(unstopped.token_ids) if t in (stop_id, tiny.model.config.eos_token_id))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == unstopped.token_ids[: end + 1]


@pytest.mark.parametrize("bad", [{"top_p": 1.5}, {"temperature": -0.5}, {"n": 0}, {"top_k": 0}, {"max_new_tokens": 0}])
def test_bad_sampling_params_are_rejected_before_any_request(engine, bad):
    requests_before = _generate_requests_seen(engine)
    field = next(iter(bad))
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        engine.generate(PROMPTS, SamplingParams(**bad))
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate(PROMPTS, {"temperature": 1.0})
    assert _generate_requests_seen(engine) == requests_before


def _generate_requests_seen(engine) -> int | None:
    """For SGLang: how many /generate requests its access log shows (the real server's own count)."""
    servers = getattr(engine, "servers", None)
    if servers is None:
        return None
    return sum(server.log_path.read_text(errors="replace").count('"POST /generate') for server in servers)


def test_bucketed_weight_push_serves_the_new_weights(engine, tiny):
    new_model = random_llama(seed=1, eos_token_id=tiny.model.config.eos_token_id)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    before = engine.generate(PROMPTS, params)
    try:
        # 0.05 MB buckets: the 0.4 MB model goes over in several pushes.
        stats = engine.update_weights(new_model.state_dict().items(), bucket_megabytes=0.05)
        assert stats.num_buckets > 3 and stats.num_tensors == len(new_model.state_dict())
        after = engine.generate(PROMPTS, params)
        assert [s.token_ids for (s,) in after] != [s.token_ids for (s,) in before]
        for prompt, (sample,) in zip(PROMPTS, after):
            argmax = teacher_forced_logits(new_model, prompt, sample.token_ids).argmax(dim=-1)
            assert sample.token_ids == argmax.tolist()
            assert_log_probs_match(new_model, prompt, sample, 0.0)
    finally:
        engine.update_weights(tiny.model.state_dict().items(), bucket_megabytes=1.0)
    assert_same_outputs(engine.generate(PROMPTS, params), before)


def test_weight_update_errors_name_the_problem(engine, tiny):
    name, tensor = next(iter(tiny.model.state_dict().items()))
    with pytest.raises(WeightUpdateError, match="begin_weight_update"):
        engine.push_weights([(name, tensor)])
    engine.begin_weight_update()
    try:
        with pytest.raises(WeightUpdateError, match="model.layers.99.mlp.up_proj.weight"):
            engine.push_weights([("model.layers.99.mlp.up_proj.weight", tensor)])
        with pytest.raises(WeightUpdateError, match=name):
            engine.push_weights([(name, tensor[:-1])])
        with pytest.raises(RolloutError, match="end_weight_update"):
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    finally:
        engine.end_weight_update()


def test_pause_with_abort_returns_aborted_requests_then_generation_continues(engine):
    long_run = SamplingParams(max_new_tokens=480, temperature=1.0, ignore_eos=True)
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.setdefault("results", engine.generate(PROMPTS[:2], long_run)))
    worker.start()
    time.sleep(0.5)
    engine.pause_generation("abort")
    worker.join(timeout=120)
    assert not worker.is_alive()
    for samples in outcome["results"]:
        for sample in samples:
            assert sample.finish_reason == "abort"
            assert len(sample.token_ids) < 480 and len(sample.log_probs) == len(sample.token_ids)
    engine.continue_generation()
    (sample,), = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    assert sample.finish_reason == "length" and len(sample.token_ids) == 4


def test_memory_release_then_resume_weights_push_and_resume_cache(engine, tiny):
    """The colocated hand-off: released weights are gone until pushed again (SGLang's memory saver
    drops them too); resume weights -> push -> resume KV cache serves the model as before."""
    assert engine.health()
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    before = engine.generate(PROMPTS[:1], params)
    engine.release_memory()
    engine.resume_memory(["weights"])
    engine.update_weights(tiny.model.state_dict().items(), bucket_megabytes=0.01)
    engine.resume_memory(["kv_cache", "cuda_graph"])
    assert engine.health()
    assert_same_outputs(engine.generate(PROMPTS[:1], params), before)
