"""LoRA on the Megatron actor (engine.models.lora): one 4-rank launch of
tests/dist_workers/lora_parity.py on a tiny HF Llama, TP1 (DP4), TP2+SP packed, PP2 with dynamic
batching, TP2xPP2 packed and PP2xVPP2 packed. Losses, gradient norms and updated adapters must match TP1 (fp32,
rel. 1e-5); base weights stay bit-identical; adapters off = the base model exactly; the merged
weights pushed through the HybridEngine and the PEFT export loaded by ``peft`` both give the
trainer's log-probs.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.models.lora import LoRASettings
from tests.distributed import run_torchrun
from tests.rollout_support import requires_sglang
from tests.dist_workers.roles_parity import make_batch
from tests.dist_workers.lora_parity import engine_log_probs
from tests.test_roles import tiny_llama  # noqa: F401 (fixture)

LAYOUTS = ["1,1,0,0,0,0", "2,1,0,1,1,0", "1,2,0,0,0,1", "2,2,0,0,1,0", "1,2,2,0,1,0"]  # tp,pp,vpp,sp,packing,dynamic
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def lora_run(tiny_llama, tmp_path_factory):  # noqa: F811
    out_dir = tmp_path_factory.mktemp("lora")
    run_torchrun("lora_parity.py", 4, ["--hf-dir", str(tiny_llama), "--out", str(out_dir / "r.json"),
                                       "--out-dir", str(out_dir), "--peft-dir", str(out_dir / "peft"),
                                       "--layouts", *LAYOUTS], timeout=600)
    results = json.loads((out_dir / "r.json").read_text())
    adapters = {layout: torch.load(out_dir / f"{layout.replace(',', '_')}.pt") for layout in LAYOUTS}
    return results, adapters, out_dir


def test_layouts_match_tp1(lora_run):
    results, adapters, _ = lora_run
    reference, reference_adapters = results[LAYOUTS[0]], adapters[LAYOUTS[0]]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
        value = reference["actor"][key]
        for layout in LAYOUTS[1:]:
            assert results[layout]["actor"][key] == pytest.approx(value, rel=TOLERANCE, abs=1e-7), (layout, key)
    assert len(reference_adapters) == 4 * 7 * 2  # layers x (q, k, v, o, gate, up, down) x (A, B)
    for layout in LAYOUTS[1:]:
        assert adapters[layout].keys() == reference_adapters.keys()
        for name, tensor in reference_adapters.items():
            error = (adapters[layout][name] - tensor).abs().max() / tensor.abs().max()
            assert error <= TOLERANCE, (layout, name, float(error))


def test_adapters_go_to_the_replica_leaders_only_in_buckets(lora_run):
    """Issue 45, defect 8 (``engine/sync/weight_sync.py`` ``_push_adapters`` gathered every adapter
    tensor on every rank, a broadcast and a device-to-host copy each, ~1k per step at 70B): exported
    to ranks 1 and 3 only, those two get every adapter exactly, ranks 0 and 2 get none, and a rank
    sends one message per 32 KiB bucket and destination, far fewer than one per tensor."""
    results, adapters, _ = lora_run
    tensors = len(adapters[LAYOUTS[0]])
    for layout in LAYOUTS:
        ranks = results[layout]["leaders_only"]
        assert [rank["tensors"] for rank in ranks] == [0, tensors, 0, tensors], (layout, ranks)
        assert ranks[1]["equal_to_rank_0"] and ranks[3]["equal_to_rank_0"], layout
        sends = [rank["sends"] for rank in ranks]
        assert all(set(destinations) <= {1, 3} for destinations in sends), (layout, sends)
        assert 0 < sum(len(destinations) for destinations in sends) < tensors / 4, (layout, sends)


def test_base_frozen_and_adapters_off_is_the_base_model(lora_run, tiny_llama):  # noqa: F811
    results, _, _ = lora_run
    for layout in LAYOUTS:
        result = results[layout]
        assert result["base_weights_bit_identical"], layout
        assert result["disabled_equals_base"], layout
        assert result["adapters_change_log_probs"] > 0.1, layout  # the adapters do act when on
    # Only adapters train: rank 4 on q/k/v/o/gate/up/down of 4 layers (hidden 64, ffn 128) = 13,312
    # parameters at TP1, and on each rank what launch.plan's memory model counts for its layers.
    assert results[LAYOUTS[0]]["trainable_parameters_on_rank"] == 13312
    from engine.models.hf_config import architecture_from_hf
    from launch.memory_model import adapter_parameters

    architecture = architecture_from_hf(tiny_llama)
    targets = LoRASettings(4, 8, ("all-linear",)).megatron_layers()
    for layout in LAYOUTS:
        tp, pp = (int(x) for x in layout.split(",")[:2])
        planned = adapter_parameters(architecture, tp, 4, targets) * architecture.num_layers // pp
        assert results[layout]["trainable_parameters_on_rank"] == planned, layout


def test_checkpoint_holds_the_adapters_only_and_restores_them(lora_run):
    results, _, _ = lora_run
    for layout in LAYOUTS:
        round_trip = results[layout]["checkpoint_round_trip"]
        assert round_trip["equal"], layout
        sizes = round_trip["tensor_sizes"]
        # 4 adapted layers x (A, B) of weights, nothing of the base; the distributed optimizer's
        # state (dp_reshardable: its gradient buckets, each parameter starting on a 64-element
        # boundary) holds as many elements per moment as the adapters, and no more.
        weights = [key for key in sizes if not key.startswith("optimizer.")]
        assert len(weights) == 8 and all("_adapter.lora_" in key for key in weights), (layout, sizes)
        for moment in ("param", "exp_avg", "exp_avg_sq"):
            stored = sum(size for key, size in sizes.items() if key.startswith("optimizer.") and key.endswith(f".{moment}"))
            assert round_trip["adapter_numel"] <= stored < round_trip["adapter_numel"] + 64 * 8 * 4, (layout, moment, sizes)


def test_merged_weights_in_the_engine_give_the_trainers_log_probs(lora_run):
    results, _, _ = lora_run
    for layout in LAYOUTS:
        assert results[layout]["engine_vs_trainer_log_probs"] < 1e-5, layout
        assert results[layout]["export_equals_engine"], layout  # the merged HF export, bit for bit


@pytest.mark.sglang
@requires_sglang
def test_adapters_and_merged_weights_pushed_into_sglang(tiny_llama, tmp_path):  # noqa: F811
    """TP2+SP training, a real SGLang server at generation TP 2 with LoRA enabled (fp32, CPU): before
    any push it serves the base (its log-probs differ from transformers' on the merged export, which
    the embedded engine equals bit for bit); after the adapters-only push (lora_sync=adapters) and
    after the merged push they equal them, the two give the same greedy tokens, and the adapters push
    moved exactly the PEFT adapters' bytes."""
    run_torchrun("lora_parity.py", 2, ["--hf-dir", str(tiny_llama), "--out", str(tmp_path / "r.json"),
                                       "--out-dir", str(tmp_path), "--layouts", "2,1,0,1,1,0", "--engine", "sglang"],
                 timeout=900)
    result = json.loads((tmp_path / "r.json").read_text())["2,1,0,1,1,0"]["sglang"]
    stages = ("before_push", "after_adapters_push", "after_push")
    assert all(result[stage]["tokens"] == 24 for stage in stages), result
    assert result["before_push"]["max_abs_difference"] > 1e-2, result  # the server starts from the base
    assert result["after_adapters_push"]["max_abs_difference"] < 1e-4, result
    assert result["after_push"]["max_abs_difference"] < 1e-4, result
    assert result["same_tokens"] and result["adapters_vs_merged"] < 1e-4, result
    assert result["adapters_push"]["bytes"] == result["adapters_push"]["peft_bytes"] > 0, result


def test_peft_export_loads_with_peft(lora_run, tiny_llama):  # noqa: F811
    import peft
    from transformers import AutoModelForCausalLM

    _, _, out_dir = lora_run
    config = json.loads((out_dir / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    saved = torch.load(out_dir / "trainer_log_probs.pt")
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, out_dir / "peft").eval()
    batch = make_batch(base.config.vocab_size, saved["batch_seed"])
    mask = batch.response_mask.bool()
    with_adapter = engine_log_probs(model, batch)
    assert float((with_adapter - saved["log_probs"].double())[mask].abs().max()) < 1e-5
    with model.disable_adapter():
        without = engine_log_probs(model, batch)
    assert float((without - saved["log_probs"].double())[mask].abs().max()) > 1e-2  # the adapter matters


def test_target_modules():
    assert LoRASettings(4, 8, ("all-linear",)).megatron_layers() == (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    attention = LoRASettings(4, 8, ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert attention.megatron_layers() == ("self_attention.linear_qkv", "self_attention.linear_proj")
    assert attention.peft_target_modules() == ["q_proj", "k_proj", "v_proj", "o_proj"]
    with pytest.raises(ValueError, match="adapt all of them or none .missing: k_proj, v_proj"):
        LoRASettings(4, 8, ("q_proj", "o_proj")).megatron_layers()
    with pytest.raises(ValueError, match="unknown module 'qkv'"):
        LoRASettings(4, 8, ("qkv",)).megatron_layers()


def test_the_embedded_engine_serves_pushed_adapters(tiny_llama, tmp_path):  # noqa: F811
    """``TorchRolloutEngine.push_adapters`` (rollout.lora_sync=adapters): it serves base + adapters as
    PEFT does (teacher-forced log-probs of its greedy tokens equal a PeftModel's), a second push
    replaces the adapters, releasing and resuming its memory keeps the base weights (no push brings
    them back), and a weight push drops the adapters (the merged weights hold them). The PEFT names
    and the adapter elements are those of engine.models.lora."""
    import peft
    from transformers import AutoModelForCausalLM

    from engine.config import RolloutConfig
    from engine.models.hf_config import architecture_from_hf, load_hf_config
    from engine.rollout.base import SamplingParams, WeightUpdateError
    from engine.rollout.torch_engine import TorchRolloutEngine
    from tests.dist_workers.reshard_sync import hf_log_probs

    settings = LoRASettings(4, 8, ("all-linear",))
    reference = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32),
                                    peft.get_peft_config(settings.peft_config()))
    plain = TorchRolloutEngine(str(tiny_llama), RolloutConfig(name="torch", dtype="float32"), device="cpu")
    prompts, greedy = [[5, 6, 7], [11, 3, 8, 2]], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    base = [sample.token_ids for (sample,) in plain.generate(prompts, greedy)]
    with pytest.raises(WeightUpdateError, match="serves no LoRA adapters"):
        plain.push_adapters({}, settings.peft_config())
    engine = TorchRolloutEngine(str(tiny_llama), RolloutConfig(name="torch", dtype="float32"), device="cpu",
                                lora=settings)
    # Started with LoRA, it serves the base (B = 0) and keeps it across a release before any push.
    engine.release_memory()
    engine.resume_memory()
    assert [sample.token_ids for (sample,) in engine.generate(prompts, greedy)] == base

    def served_matches_reference() -> list[list[int]]:
        samples = [sample for (sample,) in engine.generate(prompts, greedy)]
        for prompt, sample in zip(prompts, samples):
            expected = hf_log_probs(reference, prompt, sample.token_ids).double()
            assert torch.allclose(torch.tensor(sample.log_probs, dtype=torch.float64), expected, atol=1e-5)
        return [sample.token_ids for sample in samples]

    for draw in (1, 2):
        generator = torch.Generator().manual_seed(draw)
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        tensors = peft.get_peft_model_state_dict(reference)
        architecture = architecture_from_hf(load_hf_config(tiny_llama))
        assert sum(t.numel() for t in tensors.values()) == settings.peft_elements(architecture)
        engine.push_adapters(tensors, settings.peft_config())
        adapted = served_matches_reference()
        assert adapted != base
        engine.release_memory()
        engine.resume_memory()
        assert served_matches_reference() == adapted
    engine.begin_weight_update()  # a merged push: the adapters go, the base stays until pushed over
    engine.end_weight_update()
    assert [sample.token_ids for (sample,) in engine.generate(prompts, greedy)] == base
    with pytest.raises(WeightUpdateError, match="serves no LoRA adapters"):
        engine.push_adapters(tensors, settings.peft_config())
    engine.shutdown()
    plain.shutdown()
