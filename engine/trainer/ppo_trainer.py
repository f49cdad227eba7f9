"""The PPO loop (SPMD: every rank runs it; the roles split the work over the Megatron mesh).

One iteration, in the order of the classic RLHF recipe (Ouyang et al. 2022; HybridFlow 2024):
rollout -> old log-probs -> reference log-probs -> values -> rewards -> KL in the reward ->
advantages -> critic update -> actor update -> weight sync into the rollout engine.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from engine.algo.advantages import AdvantageInputs, compute_advantages
from engine.algo.dapo import groups_with_spread, overlong_penalty
from engine.algo.kl import apply_kl_penalty
from engine.algo.rollout_correction import compute_rollout_correction
from engine.algo.stats import masked_mean
from engine.config import ExperimentConfig
from engine.models.attention import attention_path
from engine.models.checkpoint import save_peft_adapter
from engine.data import PromptBatch
from engine.rewards.combine import RewardScores, combine_rewards
from engine.rewards.manager import decode_responses, token_level_scores
from engine.rewards.spmd import score_on_all_ranks
from engine.roles import RolloutBatch
from engine.rollout.agentic.trajectory import trajectory_metrics
from engine.rollout.base import SamplingParams
from engine.rollout.memory import record
from engine.sync import check_rollout_log_probs
from engine.trainer import watchdog
from engine.trainer.checkpoint import export_hf_model
from engine.trainer.components import PPOComponents, build_components
from engine.trainer.console import say
from engine.trainer.fault_injection import RESTART_COUNT_ENV, kill_if_asked
from engine.trainer.flops import DecoderShape, model_flops_utilization, peak_flops_per_device, training_flops
from engine.trainer.profiling import StepProfiler
from engine.trainer.dynamic_sampling import ScoredRollout, fill_with_groups_with_spread
from engine.trainer.run_dir import RunDirectory
from engine.trainer.tracking import Tracker, phase, step_peak_memory
from parallel.device import decide as decide_device

logger = logging.getLogger(__name__)


def run_ppo(cfg: ExperimentConfig) -> dict[str, float]:
    """Train; returns the last iteration's metrics. Process groups must already be up."""
    run, trainer = RunDirectory.create(cfg.trainer.default_local_dir), cfg.trainer
    rank = dist.get_rank()
    if rank == 0:
        run.write_config(cfg)
    say(f"[trident] {trainer.project_name}/{trainer.experiment_name}: {run.summary()}")
    # decided by launch.main, before CUDA was asked
    packed, cp = cfg.actor_rollout_ref.model.use_remove_padding, cfg.actor_rollout_ref.actor.megatron.context_parallel_size
    say(f"[trident] {decide_device(trainer.device).banner()}; attention: {attention_path(packed, cp)}")
    profiler = StepProfiler(trainer.profile, rank, run.profile_dir)
    parts = build_components(cfg, run)
    with parts.checkpointed_parts_resident():
        step = resume_from_checkpoint(cfg, parts)
    parts.rollout.wake_and_sync(step + 1)  # the engine (started released) serves exactly the (possibly resumed) actor
    tracker = Tracker(trainer.logger, run=run, total_steps=parts.total_training_steps, start_step=step,
                      project=trainer.project_name, experiment=trainer.experiment_name,
                      config=OmegaConf.to_container(OmegaConf.structured(cfg)), prometheus_port=trainer.prometheus_port)
    metrics: dict[str, float] = {}
    if parts.val_loader is not None and (trainer.val_only or (trainer.val_before_train and step == 0)):
        metrics = validate(cfg, parts)
        tracker.log(metrics, step)
    batches = TrainingPrompts(parts.train_loader, ahead=trainer.max_staleness)
    hang_minutes = watchdog.timeout_minutes(trainer.hang_timeout_minutes, trainer.collective_timeout_minutes)
    with watchdog.watching(hang_minutes, run.stacks_dir, rank, dist.get_world_size()):
        while step < parts.total_training_steps and not trainer.val_only:
            prompts, upcoming = batches.next(steps_left=parts.total_training_steps - step)
            step += 1
            watchdog.at_step(step)
            kill_if_asked(rank, step)  # a failure test's lost rank (never set in production)
            parts.checkpoints.finalize()  # an asynchronous save whose writers are done becomes complete
            # save_freq -1: only at the end of the run. Saved after training, before the engine wakes.
            save_due = step == parts.total_training_steps or (trainer.save_freq > 0 and step % trainer.save_freq == 0)
            with profiler.step(step):
                metrics = ppo_iteration(cfg, parts, prompts, step, upcoming=upcoming, more_prompts=batches.more,
                                        save=(lambda: save_checkpoint(parts, step, batches.sampler_state))
                                        if save_due else None)
            if parts.val_loader is not None and trainer.test_freq > 0 and step % trainer.test_freq == 0:
                metrics.update(validate(cfg, parts))
            tracker.log(metrics, step)
    parts.checkpoints.close()  # waits for an asynchronous save still being written
    tracker.close()
    parts.rollout.shutdown()
    if parts.judge_server is not None:
        parts.judge_server.stop()
    if not trainer.val_only:
        with parts.actor.offloader.resident("params"):
            export_actor(cfg, parts, run)
    say(f"[trident] done after {step} steps: {tracker.summary()}\n[trident] {run.summary()}")
    return metrics


def export_actor(cfg: ExperimentConfig, parts: PPOComponents, run: RunDirectory) -> None:
    """The trained actor as a HuggingFace folder (``trainer.export_hf_at_end``; with LoRA the
    adapters merged into the base) and, with LoRA, the adapters alone as a PEFT folder."""
    model = cfg.actor_rollout_ref.model
    if model.lora_rank:
        save_peft_adapter(parts.actor.model_chunks, run.hf_export_dir("actor_adapter"),
                          base_model_name_or_path=model.path)
        say(f"[trident] actor's LoRA adapters exported as a PEFT folder: {run.hf_export_dir('actor_adapter')}")
    if cfg.trainer.export_hf_at_end:
        path = export_hf_model(parts.actor.model_chunks, run.hf_export_dir("actor"), copy_non_weight_files_from=model.path)
        say(f"[trident] actor exported as a HuggingFace model{' (adapters merged)' if model.lora_rank else ''}: {path}")


class TrainingPrompts:
    """Endless training batches, epoch after epoch. ``next(steps_left)`` gives a step's ``(prompts,
    upcoming)``: ``upcoming`` are the batches newly drawn to generate ahead, so that ``ahead`` of
    them (``trainer.max_staleness``), no more than the steps left after this one, are in flight.
    ``more()`` takes another batch, with the same upcoming ones, for the same step (dynamic
    sampling). ``sampler_state`` is the loader's position right after the step's own batches were
    drawn, which a checkpoint saves: batches still generating ahead are drawn again and regenerated
    after a resume."""

    def __init__(self, loader, ahead: int) -> None:
        self._stream = self._drawn(loader)
        self._ahead = ahead
        self._in_flight: collections.deque = collections.deque()  # (prompts, loader state after them)
        self._steps_left = 1  # of the run, counting the current step
        self.sampler_state: dict | None = None

    @staticmethod
    def _drawn(loader):
        while True:
            for prompts in loader:
                yield prompts, loader.state_dict()

    def next(self, steps_left: int):
        self._steps_left = steps_left
        return self.more()

    def more(self):
        """The next batch in order (the oldest in flight, if any) and the batches newly drawn to
        keep ``ahead`` in flight, none for after the last step; ``next`` without a new step."""
        prompts, self.sampler_state = self._in_flight.popleft() if self._in_flight else next(self._stream)
        upcoming = []
        while len(self._in_flight) < min(self._ahead, self._steps_left - 1):
            self._in_flight.append(next(self._stream))
            upcoming.append(self._in_flight[-1][0])
        return prompts, upcoming


def ppo_iteration(cfg: ExperimentConfig, parts: PPOComponents, prompts, step: int, upcoming=(),
                  more_prompts: Callable[[], tuple[PromptBatch, list[PromptBatch]]] | None = None,
                  save: Callable[[], None] | None = None) -> dict[str, float]:
    """One PPO iteration on this rank's share of the global prompt batch; ``upcoming`` (off-policy,
    ``trainer.max_staleness``): later batches for the servers to start generating while this one
    trains; ``more_prompts`` takes another batch for dynamic sampling (``algorithm.filter_groups``),
    with upcoming ones to start (``TrainingPrompts.more``); ``save`` writes this step's checkpoint.

    Memory choreography (colocated rollout, ``engine.rollout.memory``): the engine holds its
    weights, KV cache and CUDA graphs only to generate; it releases them before the training phases
    and takes them back for the weight sync (``Rollout.wake_and_sync``), so rollout and training never
    peak together. Servers of their own keep theirs; they only have to be idle for the push. A
    checkpoint is saved between the two, while the engine sleeps, with only the weights and optimizer
    state it writes resident (slime's ``train.py``: save, then update the weights).
    """
    metrics: dict[str, float] = {}
    start = time.perf_counter()
    algo, rollout = cfg.algorithm, cfg.actor_rollout_ref.rollout
    sampling = rollout.sampling_params(cfg.data.max_response_length)
    temperature = sampling.log_prob_temperature  # the trainer's log-probs are the engine's distribution
    with phase("gen", metrics):
        generated = parts.rollout.next_batch(prompts, upcoming, sampling, rollout.n, step)
        # ReMax (Li et al. 2023): a greedy response per prompt, whose reward is the baseline.
        greedy = parts.rollout.generate(prompts, replace(sampling, temperature=0.0)) if algo.uses_greedy_baseline else None
    scored = None
    if algo.filter_groups.enable:  # DAPO's dynamic sampling: rounds while the engine is resident
        scored = _fill_with_groups_with_spread(cfg, parts, generated, more_prompts, sampling, step, metrics)
        generated = scored.rollout
    with phase("gen", metrics):
        parts.rollout.sleep()
    batch = generated
    metrics.update(_staleness_metrics(batch, step, cfg.trainer.max_staleness))
    if parts.rollout.agent is not None:  # multi-turn: turns, tool calls and their errors, truncation
        metrics.update(trajectory_metrics([sample.trajectory for sample in batch.samples]))
    metrics["rollout/server_restarts"] = parts.rollout.server_restarts
    if cfg.actor_rollout_ref.actor.use_rollout_log_probs:  # pi_old = the sampler's own log-probs, no recompute
        batch = replace(batch, old_log_probs=batch.rollout_log_probs, rollout_log_probs=None)
    else:
        with phase("old_log_prob", metrics):
            batch = replace(batch, old_log_probs=parts.actor.compute_old_log_probs(batch, temperature, metrics))
    if rollout.check_weight_sync and not parts.rollout.weight_sync.checks_by_fingerprint:
        check_rollout_log_probs(batch.rollout_log_probs, batch.old_log_probs, batch.response_mask,
                                rollout.check_weight_sync_tolerance)
    if parts.reference is not None:
        with phase("ref", metrics):
            batch = replace(batch, ref_log_probs=parts.reference.compute_ref_log_probs(batch, temperature))
    if parts.critic is not None:
        with phase("values", metrics):
            batch = replace(batch, values=parts.critic.compute_values(batch))
    with phase("reward", metrics):
        scored = scored or _score(parts, batch, cfg, training=True)
        scores, reward_metrics = scored.scores, scored.metrics
        rewards = token_level_scores(scores, batch.response_mask)
        baseline = None
        if greedy is not None:
            baseline = _score(parts, greedy, cfg).scores
            metrics["critic/greedy_score/mean"] = baseline.mean().item()
            baseline = baseline.repeat_interleave(rollout.n)
    with phase("adv", metrics):
        if algo.use_kl_in_reward:
            rewards, current_kl = apply_kl_penalty(rewards, batch.old_log_probs, batch.ref_log_probs,
                                                   batch.response_mask, parts.kl_controller.value, algo.kl_penalty)
            metrics["actor/reward_kl_penalty"] = float(current_kl)
            metrics["actor/reward_kl_penalty_coeff"] = parts.kl_controller.value
            parts.kl_controller.update(float(current_kl), len(batch))
        advantage = compute_advantages(AdvantageInputs(rewards, batch.response_mask, values=batch.values,
                                                       group_index=batch.uids, baseline_scores=baseline), algo)
        batch = replace(batch, advantages=advantage.advantages, returns=advantage.returns)
    if parts.critic is not None:
        with phase("update_critic", metrics):
            metrics.update(parts.critic.update_critic(batch))
    if step > cfg.critic.warmup_steps or parts.critic is None:
        with phase("update_actor", metrics):
            actor_batch = _corrected_for_the_rollout_policy(batch, algo, metrics)
            metrics.update(parts.actor.update_policy(actor_batch, temperature))
        metrics["perf/mfu/actor"] = _actor_update_mfu(cfg, parts, batch, metrics["timing_s/update_actor"])
    if save is not None:
        with phase("save", metrics):
            save()
    with phase("update_weights", metrics):  # every step: released weights must be pushed again
        # Servers generating ahead are made idle first (waited for, or paused with partial rollouts).
        sync, metrics["perf/wait_rollout_ahead_s"] = parts.rollout.wake_and_sync(step + 1)
    # phase() names its entries timing_s/<phase>; the step's time is its training's, the save's apart.
    metrics["timing_s/step"] = time.perf_counter() - start - metrics.get("timing_s/save", 0.0)
    metrics["perf/weight_sync_received_mb"] = sync.stats.bytes_received / 2**20  # this rank, in the engine's dtype
    metrics.update(_batch_metrics(batch, scores, reward_metrics, rollout.n))
    tokens = int(batch.attention_mask.sum())
    metrics["perf/total_num_tokens"] = tokens
    # HybridFlow's throughput: prompt + response tokens of the global batch / iteration time, per device.
    metrics["perf/throughput"] = tokens / metrics["timing_s/step"] / dist.get_world_size()
    metrics.update(step_peak_memory(metrics))
    return metrics


def _fill_with_groups_with_spread(cfg: ExperimentConfig, parts: PPOComponents, generated: RolloutBatch, more_prompts,
                                  sampling: SamplingParams, step: int, metrics: dict) -> ScoredRollout:
    """DAPO's dynamic sampling (``engine.trainer.dynamic_sampling``): the step's batch of exactly
    ``data.train_batch_size`` groups with a reward spread, generating more rounds as needed."""
    n = cfg.actor_rollout_ref.rollout.n

    def scored(batch: RolloutBatch) -> ScoredRollout:
        with phase("reward", metrics):
            return _score(parts, batch, cfg, training=True)

    def next_round() -> ScoredRollout:
        with phase("gen", metrics):
            batch = parts.rollout.next_batch(*more_prompts(), sampling, n, step)
        return scored(batch)

    batch, round_metrics = fill_with_groups_with_spread(scored(generated), next_round, cfg.algorithm.filter_groups,
                                                        cfg.data.train_batch_size, n, parts.tokenizer.pad_token_id or 0)
    metrics.update(round_metrics)
    return batch


def _corrected_for_the_rollout_policy(batch: RolloutBatch, algo, metrics: dict) -> RolloutBatch:
    """The actor's batch under ``algorithm.rollout_correction``: the engine sampled from pi_rollout,
    PPO's ratio is taken against pi_old; TIS weights scale the advantages (w > 0, so the weighted
    clipped loss is the clipped loss of w * A) and rejected tokens leave the mask."""
    if not algo.rollout_correction.enabled:
        return batch
    correction = compute_rollout_correction(batch.old_log_probs, batch.rollout_log_probs, batch.response_mask,
                                            algo.rollout_correction)
    metrics.update(correction.metrics)
    if not correction.mask.any():
        raise ValueError(f"algorithm.rollout_correction rejected every response token of the batch (rollout_rs="
                         f"{algo.rollout_correction.rollout_rs}, bounds {algo.rollout_correction.rejection_bounds()}; "
                         f"ratios from {correction.metrics['rollout_corr/is_ratio_min']:.3g} to "
                         f"{correction.metrics['rollout_corr/is_ratio_max']:.3g}): widen the bounds")
    return replace(batch, advantages=batch.advantages * correction.weights, response_mask=correction.mask)


def _staleness_metrics(generated: RolloutBatch, step: int, max_staleness: int) -> dict[str, float]:
    """Which weights sampled the batch: ``rollout/policy_version`` (those its generation started
    with), how many steps behind the trainer's its response tokens are (``rollout/staleness/mean``,
    ``/max``; per token where the engine tags them), the share of responses with tokens of more
    than one version (``rollout/partial/fraction``: continued after a weight push), and how long
    the engine generated it (``perf/rollout_generation_s``; overlapped with training when ahead)."""
    mask = generated.response_mask.bool()
    versions = generated.token_versions
    if versions is None:
        versions = torch.full(mask.shape, generated.policy_version, dtype=torch.long)
    staleness = (step - versions)[mask].float()
    if staleness.numel() and staleness.max() > max_staleness:  # the rollout queue holds only max_staleness batches
        raise RuntimeError(f"a token sampled {int(staleness.max())} versions before step {step}: more than "
                           f"trainer.max_staleness={max_staleness}")
    lowest = torch.where(mask, versions, versions.max() + 1).amin(dim=1)
    highest = torch.where(mask, versions, versions.min() - 1).amax(dim=1)
    return {"rollout/policy_version": generated.policy_version,
            "rollout/staleness/mean": staleness.mean().item() if staleness.numel() else 0.0,
            "rollout/staleness/max": staleness.max().item() if staleness.numel() else 0.0,
            "rollout/partial/fraction": (highest > lowest).float().mean().item(),
            "perf/rollout_generation_s": generated.generation_s}


def _actor_update_mfu(cfg: ExperimentConfig, parts: PPOComponents, batch: RolloutBatch, seconds: float) -> float | None:
    """Model FLOPs of the actor's PPO epochs over the batch / (time x the devices' peak); None where
    the peak is unknown (CPU, fp32, unlisted GPUs), so the metric is absent rather than wrong."""
    shape = DecoderShape.from_architecture(parts.actor.model_chunks[0].hf_architecture)
    flops = cfg.actor_rollout_ref.actor.ppo_epochs * training_flops(shape, batch.attention_mask.sum(dim=1).tolist())
    peak = peak_flops_per_device(dtype=getattr(torch, cfg.actor_rollout_ref.actor.megatron.param_dtype))
    return model_flops_utilization(flops, seconds, dist.get_world_size(), peak)


def _score(parts: PPOComponents, batch: RolloutBatch, cfg: ExperimentConfig, training: bool = False) -> ScoredRollout:
    """The reward of each response, ``[B]`` on every rank: its rule score (each response scored on
    one rank, ``score_on_all_ranks``, on the text the model wrote: every turn's, appended messages
    excepted), reward-model score and judge score, combined by ``reward_model.combine``, plus a
    multi-turn environment's reward and DAPO's overlong penalty (``reward_model.overlong_buffer``); the
    scores of each source; and the ``reward/*`` metrics. ``training`` counts failing rule calls (a
    function that keeps failing stops the run)."""
    samples = batch.samples
    responses = decode_responses(parts.tokenizer, batch.input_ids[:, -batch.response_length:], batch.response_mask)
    sources, metrics = RewardScores(), {}
    if parts.scores_rules:
        data_sources = [s.data_source for s in samples]
        rule = score_on_all_ranks(parts.rewards, responses, data_sources, [s.ground_truth for s in samples],
                                  [s.extra_info for s in samples])
        if training:
            parts.rewards.check_training_step(rule, data_sources)
        sources.rule = rule.scores
        metrics.update(rule.metrics)
    if parts.reward_model is not None:
        sources.model, model_metrics = parts.reward_model.score(batch, [s.messages for s in samples], responses)
        metrics.update(model_metrics)
    if parts.judge is not None:
        sources.judge, judge_metrics = parts.judge.score_on_all_ranks([s.messages for s in samples], responses)
        metrics.update(judge_metrics)
    scores, combined_metrics = combine_rewards(sources, cfg.reward_model.combine)
    metrics.update(combined_metrics)
    environment = [s.trajectory.env_reward for s in samples]
    if any(reward is not None for reward in environment):  # multi-turn environments' own rewards join the score
        environment = torch.tensor([reward or 0.0 for reward in environment], dtype=scores.dtype)
        scores = scores + environment
        metrics["reward/environment/mean"] = environment.mean().item()
    overlong = cfg.reward_model.overlong_buffer
    if overlong.enable:
        penalty = overlong_penalty(batch.response_mask.sum(dim=1), cfg.data.max_response_length, overlong.len,
                                   overlong.penalty_factor)
        scores = scores + penalty
        metrics["reward/overlong_penalty/mean"] = penalty.mean().item()
    return ScoredRollout(batch, scores, sources, metrics)


def _batch_metrics(batch: RolloutBatch, scores, reward_metrics, n: int) -> dict[str, float]:
    """The trained batch's metrics; with ``n`` responses per prompt, how many prompt groups it has and
    the fraction whose rewards differ (the rest teach a group estimator nothing; see
    ``algorithm.filter_groups``)."""
    mask = batch.response_mask
    lengths = mask.sum(dim=1)
    if n > 1:
        reward_metrics = {**reward_metrics, "critic/groups/count": len(batch) / n,
                          "critic/groups_with_spread/fraction": groups_with_spread(scores, n).float().mean().item()}
    metrics = {
        "critic/score/mean": scores.mean().item(), "critic/score/max": scores.max().item(),
        "critic/score/min": scores.min().item(),
        "response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
        "critic/advantages/mean": masked_mean(batch.advantages, mask).item(),
        "critic/returns/mean": masked_mean(batch.returns, mask).item(),
        **reward_metrics,
    }
    if batch.rollout_log_probs is not None:  # train/inference mismatch: the engine's log-probs vs the trainer's recomputation
        metrics["rollout/log_prob_abs_diff"] = masked_mean((batch.rollout_log_probs - batch.old_log_probs).abs(), mask).item()
    if batch.values is not None:
        from engine.algo.losses import explained_variance

        metrics["critic/values/mean"] = masked_mean(batch.values, mask).item()
        metrics["critic/vf_explained_var"] = float(explained_variance(batch.values, batch.returns, mask))
    return metrics


def validate(cfg: ExperimentConfig, parts: PPOComponents) -> dict[str, float]:
    """Scores of the validation responses: ``rollout.val_kwargs.n`` per prompt with its sampling
    (one greedy response by default). ``val/score/mean`` is the reward (all sources combined),
    ``val/reward_model/mean`` the reward model's score; ``val/accuracy`` counts responses whose rule
    score is 1, and with n > 1 ``val/pass_at_<n>`` prompts with at least one (both need rule scores);
    multi-turn runs add the trajectories' ``rollout/*`` metrics as ``val/*`` (``val/tool_calls/mean``)."""
    # Validation draws from a fork of the random streams: training's own continue as if it had not
    # run, so a step's checkpoint (saved before it) resumes exactly whatever validation sampled.
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        return _validate(cfg, parts)


def _validate(cfg: ExperimentConfig, parts: PPOComponents) -> dict[str, float]:
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    params = val.sampling_params(cfg.data.max_response_length)
    rewards: list[float] = []
    model_scores: list[float] = []
    per_prompt: list[list[float]] = []  # rule scores; each prompt's n responses are consecutive
    trajectories = []
    for prompts in parts.val_loader:
        generated = parts.rollout.generate(prompts.repeat_interleave(val.n), params)
        trajectories += [sample.trajectory for sample in generated.samples]
        scored = _score(parts, generated, cfg)
        scores, sources = scored.scores, scored.sources
        rewards += scores.tolist()
        if sources.model is not None:
            model_scores += sources.model.tolist()
        if sources.rule is not None:
            per_prompt += [sources.rule[i:i + val.n].tolist() for i in range(0, len(sources.rule), val.n)]
    metrics = {"val/score/mean": float(sum(rewards) / max(len(rewards), 1))}
    if parts.rollout.agent is not None:  # multi-turn: val/turns/mean, val/tool_calls/mean, ...
        metrics.update({key.replace("rollout/", "val/"): value for key, value in trajectory_metrics(trajectories).items()})
    if model_scores:
        metrics["val/reward_model/mean"] = float(sum(model_scores) / len(model_scores))
    if per_prompt:
        rule = [score for group in per_prompt for score in group]
        metrics["val/accuracy"] = float(sum(s >= 1.0 for s in rule) / len(rule))
        if val.n > 1:
            metrics[f"val/pass_at_{val.n}"] = float(sum(max(group) >= 1.0 for group in per_prompt) / len(per_prompt))
    return metrics


def save_checkpoint(parts: PPOComponents, step: int, sampler_state: dict) -> None:
    """Everything ``resume_from_checkpoint`` needs to continue exactly after ``step`` (collective);
    ``sampler_state``: the loader's position after the batches of ``step`` (``TrainingPrompts``)."""
    extra = {"step": step, "sampler": sampler_state, "kl_controller": parts.kl_controller.state_dict(),
             # the roles seed each update's mini-batch shuffle with their call count
             "update_calls": {name: role.num_update_calls for name, role in _trained_roles(parts).items()}}
    with parts.checkpointed_parts_resident():  # an asynchronous save has set the tensors aside when this returns
        record("save", resident=parts.resident_parts())
        parts.checkpoints.save(step, parts.checkpoint_targets(), extra_state=extra)


def _trained_roles(parts: PPOComponents) -> dict:
    return {"actor": parts.actor, **({"critic": parts.critic} if parts.critic is not None else {})}


def resume_from_checkpoint(cfg: ExperimentConfig, parts: PPOComponents) -> int:
    """Load the checkpoint ``trainer.resume_mode`` picks into ``parts``; the step it ends, or 0."""
    path = parts.checkpoints.resolve_resume(cfg.trainer.resume_mode, cfg.trainer.resume_from_path)
    restarts = int(os.environ.get(RESTART_COUNT_ENV, "0"))  # torchrun's (and the Ray launcher's) --max-restarts
    if restarts:
        say(f"[trident] restart {restarts} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')} after a rank failed: "
            + (f"resuming from {path}" if path else f"no checkpoint to resume (trainer.resume_mode="
                                                    f"{cfg.trainer.resume_mode}): starting at step 1"))
    if path is None:
        return 0
    extra = parts.checkpoints.load(path, parts.checkpoint_targets())
    parts.train_loader.load_state_dict(extra["sampler"])
    parts.kl_controller.load_state_dict(extra["kl_controller"])
    for name, role in _trained_roles(parts).items():
        role.num_update_calls = extra["update_calls"][name]
    say(f"[trident] resumed from {path} (step {extra['step']})")
    return int(extra["step"])
