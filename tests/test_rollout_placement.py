"""Where colocated SGLang replicas run: exactly the GPUs of the training ranks they serve.

The server command lines are built as on a GPU node (``needs_cpu_adaptation`` patched off); nothing
is started. Ranks are numbered as torchrun does: node n holds ranks n*G .. n*G + G - 1 and rank r
trains on local GPU r % G.
"""
from __future__ import annotations

import pytest

from engine.config import ConfigError, RolloutConfig, load_config
from engine.rollout import sglang_server
from engine.rollout.base import RolloutError
from engine.rollout.sglang_engine import SGLangRolloutConfig
from engine.rollout.sglang_server import SGLangServer, SGLangServerConfig, visible_devices
from tests.rollout_support import requires_sglang
from parallel.hybrid_engine import GenerationLayout, HybridLayout, TrainingLayout
from parallel.layout import LayoutError


def hybrid(tp: int, pp: int, dp: int, tg: int) -> HybridLayout:
    return HybridLayout(TrainingLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                       data_parallel_size=dp), GenerationLayout(tg))


def server_commands(layout: HybridLayout, gpus_per_node: int, monkeypatch, tmp_path) -> list[tuple[int, list, dict]]:
    """(node, args, env) of every replica's server, as its leader rank would start it on a GPU node."""
    monkeypatch.setattr(sglang_server, "needs_cpu_adaptation", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    commands = []
    for placement in layout.replica_placements(gpus_per_node):
        server = SGLangServer(SGLangServerConfig(
            model_path=str(tmp_path), log_path=tmp_path / "log", gpu_ids=placement.local_devices,
            rollout=RolloutConfig(tensor_model_parallel_size=layout.generation.tensor_model_parallel_size)))
        commands.append((placement.node, *server.command()))
    return commands


@pytest.mark.parametrize("tg, expected", [
    (1, ["0", "1", "2", "3", "4", "5", "6", "7"]),
    # tg < T: the HybridEngine's generation groups take every T/tg-th rank of a TP group, so each
    # GPU's generation shard contains the training shard it already holds.
    (2, ["0,4", "1,5", "2,6", "3,7"]),
    (4, ["0,2,4,6", "1,3,5,7"]),
    (8, ["0,1,2,3,4,5,6,7"]),
])
def test_one_node_of_8_gpus_tp8(tg, expected, monkeypatch, tmp_path):
    layout = hybrid(tp=8, pp=1, dp=1, tg=tg)
    commands = server_commands(layout, 8, monkeypatch, tmp_path)
    assert [env["CUDA_VISIBLE_DEVICES"] for _, _, env in commands] == expected
    for (node, args, env), ranks in zip(commands, layout.generation_tensor_groups()):
        assert node == 0
        assert args[args.index("--tp-size") + 1] == str(tg)
        assert "--base-gpu-id" not in args and "--enable-memory-saver" in args
        # The server's TP rank g sits on the GPU of the replica's generation TP rank g; the leader
        # (which starts the server and pushes the weights) is first.
        assert env["CUDA_VISIBLE_DEVICES"].split(",") == [str(rank % 8) for rank in ranks]
    gpus = [gpu for _, _, env in commands for gpu in env["CUDA_VISIBLE_DEVICES"].split(",")]
    assert sorted(gpus) == [str(g) for g in range(8)]  # every GPU serves exactly one replica


def test_one_node_tp4_dp2_and_generation_across_pipeline_stages(monkeypatch, tmp_path):
    # TP4 x DP2, tg 2: four replicas, two per data-parallel rank.
    commands = server_commands(hybrid(tp=4, pp=1, dp=2, tg=2), 8, monkeypatch, tmp_path)
    assert [env["CUDA_VISIBLE_DEVICES"] for _, _, env in commands] == ["0,2", "1,3", "4,6", "5,7"]
    # TP2 x PP4, tg 4 > T: a replica joins the TP groups of two stages (P/k = 2 apart), interleaved.
    commands = server_commands(hybrid(tp=2, pp=4, dp=1, tg=4), 8, monkeypatch, tmp_path)
    assert [env["CUDA_VISIBLE_DEVICES"] for _, _, env in commands] == ["0,4,1,5", "2,6,3,7"]


def test_two_nodes_each_server_on_its_own_node(monkeypatch, tmp_path):
    layout = hybrid(tp=8, pp=2, dp=1, tg=8)  # one stage per node
    commands = server_commands(layout, 8, monkeypatch, tmp_path)
    assert [(node, env["CUDA_VISIBLE_DEVICES"]) for node, _, env in commands] == [
        (0, "0,1,2,3,4,5,6,7"), (1, "0,1,2,3,4,5,6,7")]
    layout = hybrid(tp=8, pp=1, dp=2, tg=4)  # data parallel across the nodes
    commands = server_commands(layout, 8, monkeypatch, tmp_path)
    assert [(node, env["CUDA_VISIBLE_DEVICES"]) for node, _, env in commands] == [
        (0, "0,2,4,6"), (0, "1,3,5,7"), (1, "0,2,4,6"), (1, "1,3,5,7")]


def test_a_replica_spanning_nodes_is_refused_by_the_config_check():
    # TP4 x PP4 on 2 x 8: tg 8 joins stages 0 and 2 (ranks 0-3 on node 0, 8-11 on node 1).
    with pytest.raises(LayoutError, match="span nodes"):
        hybrid(tp=4, pp=4, dp=1, tg=8).replica_placements(8)
    overrides = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
                 "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=4",
                 "critic.megatron.tensor_model_parallel_size=4", "critic.megatron.pipeline_model_parallel_size=4",
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=8", "trainer.nnodes=2"]
    with pytest.raises(ConfigError, match=r"n_gpus_per_node=8.*span nodes \[0, 1\]"):
        load_config("yaml/qwen2.5-7b_gsm8k.yaml", overrides)
    # The same layout with generation TP 4 stays inside each node.
    load_config("yaml/qwen2.5-7b_gsm8k.yaml", overrides[:-2] + ["actor_rollout_ref.rollout.tensor_model_parallel_size=4",
                                                                "trainer.nnodes=2"])


def test_gpu_ids_map_through_the_launchers_own_binding():
    assert visible_devices((0, 4), None) == "0,4"
    assert visible_devices((1, 3), "4,5,6,7") == "5,7"
    assert visible_devices((1,), "GPU-aaa, GPU-bbb") == "GPU-bbb"
    with pytest.raises(RolloutError, match=r"\[4\]"):
        visible_devices((0, 4), "2,3")


def test_engine_config_refuses_shared_or_short_gpu_lists():
    with pytest.raises(ValueError, match="two servers"):
        SGLangRolloutConfig(model_path="m", run_dir="r", rollout=RolloutConfig(tensor_model_parallel_size=2),
                            replica_gpus=((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="must hold rollout.tensor_model_parallel_size=2"):
        SGLangRolloutConfig(model_path="m", run_dir="r", rollout=RolloutConfig(tensor_model_parallel_size=2),
                            replica_gpus=((0,),))


def test_colocated_server_environment_releases_cuda_graphs_and_drops_the_trainers_allocator_settings(
        monkeypatch, tmp_path):
    """SGLang's memory saver refuses expandable segments, and captures CUDA graphs into its
    releasable "cuda_graph" region only with SGLANG_MEMORY_SAVER_CUDA_GRAPH; servers of their own keep
    their memory and need neither."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    (_, args, env), = server_commands(hybrid(tp=1, pp=1, dp=1, tg=1), 1, monkeypatch, tmp_path)
    assert "--enable-memory-saver" in args and env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "true"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env and "PYTORCH_ALLOC_CONF" not in env
    own = SGLangServer(SGLangServerConfig(model_path=str(tmp_path), log_path=tmp_path / "log", gpu_ids=(1,),
                                          rollout=RolloutConfig(mode="disaggregated", num_gpus=1)))
    args, env = own.command()
    assert "--enable-memory-saver" not in args and "SGLANG_MEMORY_SAVER_CUDA_GRAPH" not in env
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env


@requires_sglang
def test_servers_import_only_the_model_families_trident_trains(monkeypatch, tmp_path):
    """SGLang's registry imports all ~250 of its model modules unless an external package names the
    classes to use (1.5 s of CPU per TP worker): every server gets ours, which holds an SGLang class for
    each model type Trident builds; a user's own package is kept."""
    from engine.models.hf_config import MODEL_CLASS_PREFIXES
    from engine.rollout.sglang_models import families

    server = SGLangServer(SGLangServerConfig(model_path=str(tmp_path), log_path=tmp_path / "log", rollout=RolloutConfig()))
    assert server.command()[1]["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "engine.rollout.sglang_models"
    names = {entry.__name__ for entry in families.EntryClass}
    assert {f"{prefix}ForCausalLM" for prefix in MODEL_CLASS_PREFIXES.values()} <= names
    monkeypatch.setenv("SGLANG_EXTERNAL_MODEL_PACKAGE", "my_models")
    assert server.command()[1]["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "my_models"
