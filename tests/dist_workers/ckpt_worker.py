"""Worker: checkpoints of a tiny megatron actor + critic (distributed optimizer, torch Adam fallback).

Phases (``--phase``), each one torchrun launch on 2 ranks (``dp1`` on one):

``reference``: at DP2, train 4 steps uninterrupted, saving a checkpoint after step 2; record the
    losses and final weights. Then, in the same processes, train at TP2, save, re-initialise the
    parallel state at TP1 (DP2), load that checkpoint and record eval losses of both layouts
    before and after one more training step; finally round-trip the non-distributed optimizer.
``dp1``: one rank resumes the reference run's step-2 checkpoint at DP1 and trains steps 3-4.
``resume``: a fresh world at DP2 resumes from the reference run's step-2 checkpoint
    (``resume_mode=auto``), trains steps 3-4 (saving after each, ``max_ckpt_to_keep=2``), then
    exports the actor as an HF folder, then crashes inside the save of step 5 and checks the
    previous checkpoint is what resume picks.

Results go to ``--out/<phase>.pt`` (rank 0); the pytest side compares them.
"""

import argparse
from pathlib import Path

import torch

SEQ = 16
GLOBAL_BATCH = 4
BUCKET_ELEMENTS = 20_000  # the tiny models' ~50k parameters in three buckets each


def tiny_hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )


class Run:
    """Actor (LM loss) and critic (regression of values to 0.5) with megatron DDP + distributed Adam."""

    def __init__(self, layout, seed: int = 3, distributed_optimizer: bool = True, buckets: bool = False):
        """``buckets``: the gradients in several buckets (overlap_grad_reduce, GRAD_BUCKET_ELEMENTS) as
        every production-size model has them; else one per buffer."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from engine.models.gpt import build_model_chunks
        from engine.roles.optim import wrap_for_training
        from engine.trainer.checkpoint import CheckpointTarget
        from parallel.state import initialize_model_parallel

        initialize_model_parallel(layout, seed=seed)
        self.targets = {}
        for name, value_head in (("actor", False), ("critic", True)):
            # The default padding (lcm(128, TP) rows) gives the same embedding shape at TP1 and TP2.
            chunks = build_model_chunks(tiny_hf_config(), layout, value_head=value_head)
            chunks = wrap_for_training(chunks, distributed_optimizer, overlap_grad_reduce=buckets)
            optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.01,
                                use_distributed_optimizer=distributed_optimizer,
                                clip_grad=1.0, adam_beta2=0.95),
                chunks,
            )
            # Warmup over 3 steps: the learning rate differs per step, so a lost scheduler state shows.
            scheduler = OptimizerParamScheduler(
                optimizer, init_lr=1e-3, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=3, lr_decay_steps=10,
                lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=10, wd_incr_style="constant",
            )
            self.targets[name] = CheckpointTarget(chunks, optimizer, scheduler)

    @staticmethod
    def batch(step: int) -> torch.Tensor:
        """This rank's share of global batch ``step`` (the same data whatever the layout)."""
        from megatron.core import parallel_state

        tokens = torch.randint(0, 128, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))
        dp_size = parallel_state.get_data_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        share = GLOBAL_BATCH // dp_size
        return tokens[dp_rank * share:(dp_rank + 1) * share]

    def _losses(self, name: str, tokens: torch.Tensor, forward_only: bool) -> float:
        """Mean loss over the global batch (2 micro-batches per rank), after an optimizer step unless forward_only."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        target = self.targets[name]
        chunks = target.model_chunks
        positions = torch.arange(SEQ).unsqueeze(0).expand(tokens.shape[0], -1)
        micro = 1

        def micro_batches():
            for start in range(0, tokens.shape[0], micro):
                yield tokens[start:start + micro]

        def forward_step(iterator, model):
            batch = next(iterator)
            if name == "actor":
                output = model(batch, positions[: batch.shape[0]], None, labels=batch)

                def loss_func(out):
                    loss = out.float().mean()
                    return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place
            else:
                output = model(batch, positions[: batch.shape[0]], None)

                def loss_func(out):
                    loss = ((out.float() - 0.5) ** 2).mean()
                    return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place
            return output, loss_func

        if not forward_only:
            for chunk in chunks:
                chunk.zero_grad_buffer()
            target.optimizer.zero_grad()
        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=micro_batches(), model=chunks[0],
            num_microbatches=tokens.shape[0] // micro, seq_length=SEQ, micro_batch_size=micro,
            forward_only=forward_only,
        )
        if not forward_only:
            target.optimizer.step()
            target.lr_scheduler.step(1)
        local = torch.tensor(sum(r["loss"].item() for r in results) / len(results), dtype=torch.float64)
        from megatron.core import parallel_state

        torch.distributed.all_reduce(local, group=parallel_state.get_data_parallel_group())
        return local.item() / parallel_state.get_data_parallel_world_size()

    def train_step(self, step: int) -> dict[str, float]:
        tokens = self.batch(step)
        return {name: self._losses(name, tokens, forward_only=False) for name in self.targets}

    def eval_losses(self) -> dict[str, float]:
        tokens = self.batch(999)
        return {name: self._losses(name, tokens, forward_only=True) for name in self.targets}

    def weights(self) -> dict[str, dict[str, torch.Tensor]]:
        """Full HF-layout weights of each model (on rank 0), comparable across layouts."""
        from engine.models.checkpoint import export_hf_state_dict

        return {name: export_hf_state_dict([c.module for c in t.model_chunks]) for name, t in self.targets.items()}

    def adam_steps(self) -> list[float]:
        """The torch Adam ``step`` of every param of the actor's inner optimizer."""
        inner = self.targets["actor"].optimizer.chained_optimizers[0].optimizer \
            if hasattr(self.targets["actor"].optimizer, "chained_optimizers") else self.targets["actor"].optimizer.optimizer
        return [float(state["step"]) for state in inner.state.values()]

    def export_actor(self, out_dir: Path) -> dict:
        from engine.trainer.checkpoint import export_hf_model

        export_hf_model(self.targets["actor"].model_chunks, out_dir)
        if torch.distributed.get_rank() != 0:
            return {}
        from safetensors.torch import load_file

        return {"files": sorted(p.name for p in out_dir.iterdir()), "tensors": load_file(out_dir / "model.safetensors")}


def save_asynchronously(run: Run, workdir: Path, step: int) -> dict:
    """The same state saved with ``async_save``, every weight overwritten (and then put back) the
    moment ``save`` returns, while the writer may still be at work: the files must hold the weights
    as they were when it was scheduled. Complete only after ``close``."""
    from engine.trainer.checkpoint import MANIFEST_KEY, CheckpointManager, latest_checkpoint, read_checkpoint_metadata

    checkpoints = workdir / "dp2_async" / "checkpoints"
    manager = CheckpointManager(checkpoints, async_save=True)
    path = manager.save(step, run.targets, extra_state={"global_step": step})
    params = [p for target in run.targets.values() for chunk in target.model_chunks for p in chunk.parameters()]
    kept = [p.detach().clone() for p in params]
    for param in params:
        param.data.fill_(7.0)
    latest_before = latest_checkpoint(checkpoints)
    for param, value in zip(params, kept):
        param.data.copy_(value)
    manager.close()
    sync = read_checkpoint_metadata(workdir / "dp2" / "checkpoints" / f"step_{step}")[MANIFEST_KEY]
    return {"async_latest_before_close": latest_before, "async_path": str(path),
            "async_manifest": read_checkpoint_metadata(path)[MANIFEST_KEY], "sync_manifest": sync}


def phase_reference(workdir: Path) -> dict:
    from megatron.core import parallel_state

    from engine.trainer.checkpoint import CheckpointManager
    from parallel.layout import ParallelLayout

    result = {}
    run = Run(ParallelLayout(), buckets=True)
    manager = CheckpointManager(workdir / "dp2" / "checkpoints", max_ckpt_to_keep=2)  # dp_reshardable
    losses = []
    for step in (1, 2, 3, 4):
        losses.append(run.train_step(step))
        if step == 2:
            manager.save(step, run.targets, extra_state={"global_step": step, "kl_controller": {"type": "fixed", "value": 0.1},
                                                        "sampler": {"epoch": 0, "index": 2}})
            # Drawn right after saving: the resumed run must draw the same number after loading.
            result["rand_after_save"] = torch.rand(3)
            result.update(save_asynchronously(run, workdir, step))
            result["refused_fully_reshardable"] = refused(lambda: CheckpointManager(
                workdir / "dp2_full" / "checkpoints", optimizer_format="fully_reshardable").save(step, run.targets))
            result["dp2_full_written"] = (workdir / "dp2_full" / "checkpoints").exists() and any(
                (workdir / "dp2_full" / "checkpoints").iterdir())
    result["losses"] = losses
    result["weights"] = run.weights()
    result["adam_steps"] = run.adam_steps()

    # Resharding: save at TP2 (world of 2), load into TP1 x DP2 -- fully_reshardable (one bucket);
    # the same state saved dp_reshardable is refused at TP1 by name.
    parallel_state.destroy_model_parallel()
    run = Run(ParallelLayout(tensor_model_parallel_size=2), seed=5)
    for step in (1, 2):
        run.train_step(step)
    tp_manager = CheckpointManager(workdir / "tp2" / "checkpoints", optimizer_format="fully_reshardable")
    saved_dir = tp_manager.save(2, run.targets, extra_state={"global_step": 2})
    dp_manager = CheckpointManager(workdir / "tp2_dp_reshardable" / "checkpoints")
    dp_manager.save(2, run.targets, extra_state={"global_step": 2})
    result["tp2_eval"] = run.eval_losses()
    result["tp2_weights"] = run.weights()
    result["tp2_step3"] = run.train_step(3)
    result["tp2_eval_after_step3"] = run.eval_losses()

    parallel_state.destroy_model_parallel()
    run = Run(ParallelLayout(tensor_model_parallel_size=1), seed=11)
    result["tp1_eval_before_load"] = run.eval_losses()
    result["tp1_refused_dp_reshardable"] = refused(lambda: dp_manager.load(dp_manager.resolve_resume("auto"), run.targets))
    extra = tp_manager.load(tp_manager.resolve_resume("auto"), run.targets)
    result["tp1_loaded_from"] = str(saved_dir)
    result["tp1_extra"] = extra
    result["tp1_eval"] = run.eval_losses()
    result["tp1_weights"] = run.weights()
    result["tp1_step3"] = run.train_step(3)
    result["tp1_eval_after_step3"] = run.eval_losses()
    result["tp1_adam_steps"] = run.adam_steps()

    # The non-distributed optimizer (megatron's FP32Optimizer over torch Adam) round-trips as well.
    parallel_state.destroy_model_parallel()
    run = Run(ParallelLayout(), seed=13, distributed_optimizer=False)
    plain_manager = CheckpointManager(workdir / "plain" / "checkpoints")
    run.train_step(1)
    plain_manager.save(1, run.targets)
    result["plain_step2"] = run.train_step(2)
    parallel_state.destroy_model_parallel()
    run = Run(ParallelLayout(), seed=17, distributed_optimizer=False)
    plain_manager.load(plain_manager.resolve_resume("auto"), run.targets)
    result["plain_step2_after_load"] = run.train_step(2)
    return result


def refused(action) -> str | None:
    """The CheckpointError ``action`` raises, or None."""
    from engine.trainer.checkpoint import CheckpointError

    try:
        action()
    except CheckpointError as error:
        return str(error)
    return None


def phase_dp1(workdir: Path) -> dict:
    """One rank (DP1) resumes the reference run's DP2 step-2 checkpoint (dp_reshardable, three
    buckets per buffer) and trains steps 3-4."""
    from engine.trainer.checkpoint import CheckpointManager, read_checkpoint_metadata
    from parallel.layout import ParallelLayout

    run = Run(ParallelLayout(), seed=23, buckets=True)
    manager = CheckpointManager(workdir / "dp2" / "checkpoints")
    resume_from = manager.resolve_resume("auto")
    metadata = read_checkpoint_metadata(resume_from)
    manager.load(resume_from, run.targets)
    return {"resumed_from": str(resume_from), "format": metadata["distributed_optimizer_format"],
            "grad_buckets": metadata["grad_buckets"], "adam_steps_after_load": run.adam_steps(),
            "losses": [run.train_step(step) for step in (3, 4)], "adam_steps": run.adam_steps()}


def phase_resume(workdir: Path) -> dict:
    import engine.trainer.checkpoint as checkpoint
    from engine.trainer.checkpoint import CheckpointManager, latest_checkpoint, list_checkpoints
    from parallel.layout import ParallelLayout

    result = {}
    run = Run(ParallelLayout(), seed=99, buckets=True)  # a different seed: everything must come from the checkpoint
    checkpoints_dir = workdir / "dp2" / "checkpoints"
    manager = CheckpointManager(checkpoints_dir, max_ckpt_to_keep=2)
    resume_from = manager.resolve_resume("auto")
    result["resumed_from"] = str(resume_from)
    extra = manager.load(resume_from, run.targets)
    result["extra"] = extra
    result["rand_after_load"] = torch.rand(3)
    result["adam_steps_after_load"] = run.adam_steps()
    losses = []
    for step in range(extra["global_step"] + 1, 5):
        losses.append(run.train_step(step))
        manager.save(step, run.targets, extra_state={"global_step": step})
    result["losses"] = losses
    result["weights"] = run.weights()
    result["adam_steps"] = run.adam_steps()
    result["export"] = run.export_actor(workdir / "hf" / "actor")
    result["after_keep2"] = [s for s, _ in list_checkpoints(checkpoints_dir)]

    # A crash in the middle of saving step 5: the model files are written, the rest is not.
    original = checkpoint._write_rank_state

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash during save")

    checkpoint._write_rank_state = crash
    try:
        manager.save(5, run.targets, extra_state={"global_step": 5})
        result["crash_raised"] = False
    except RuntimeError as err:
        result["crash_raised"] = "simulated crash" in str(err)
    finally:
        checkpoint._write_rank_state = original
    torch.distributed.barrier()
    result["tmp_left"] = sorted(p.name for p in checkpoints_dir.iterdir())
    result["latest_after_crash"] = str(latest_checkpoint(checkpoints_dir))
    result["resume_after_crash"] = str(manager.resolve_resume("auto"))
    before = run.weights()
    extra = manager.load(manager.resolve_resume("auto"), run.targets)
    result["extra_after_crash"] = extra
    after = run.weights()
    if torch.distributed.get_rank() == 0:
        result["reload_same_weights"] = all(torch.equal(before[m][k], after[m][k]) for m in before for k in before[m])
    manager.save(5, run.targets, extra_state={"global_step": 5})
    result["after_resave"] = sorted(p.name for p in checkpoints_dir.iterdir())
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("reference", "dp1", "resume"), required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    workdir, out = Path(args.workdir), Path(args.out)
    import engine.roles.optim

    engine.roles.optim.GRAD_BUCKET_ELEMENTS = BUCKET_ELEMENTS
    phase = {"reference": phase_reference, "dp1": phase_dp1, "resume": phase_resume}[args.phase]
    result = phase(workdir)
    if torch.distributed.get_rank() == 0:
        torch.save(result, out / f"{args.phase}.pt")
    from parallel.state import destroy_model_parallel

    destroy_model_parallel()


if __name__ == "__main__":  # dist_checkpointing's save starts a spawn-method Manager
    main()
