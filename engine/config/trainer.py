"""``trainer.*``: the cluster, the loop's length, checkpoints, logging (read by ``engine.trainer``)."""
from __future__ import annotations

from dataclasses import dataclass, field

LOGGERS = ("console", "tensorboard", "jsonl", "wandb", "mlflow")
# Loggers whose packages are optional extras: logger -> (modules it imports, the pip extra).
LOGGER_EXTRAS = {"wandb": (("wandb",), "wandb"), "mlflow": (("mlflow", "sqlalchemy"), "mlflow")}
RESUME_MODES = ("auto", "disable", "resume_path")
# megatron's distributed-optimizer checkpoint formats (engine.trainer.checkpoint); the first is the default
OPTIMIZER_FORMATS = ("dp_reshardable", "fully_reshardable")
PROFILE_TOOLS = ("torch", "nvtx")


@dataclass
class ProfileConfig:
    """``trainer.profile``: profile chosen PPO steps on chosen ranks.

    Attributes:
        steps: the PPO steps (1-based) to profile; empty = no profiling.
        ranks: the global ranks that profile them.
        tool: "torch": a torch profiler trace per rank and step (``<run>/profile/step_<s>_rank_<r>.json``,
            chrome://tracing or Perfetto); "nvtx": the steps are bracketed by ``cudaProfilerStart/Stop``
            so ``nsys profile --capture-range=cudaProfilerApi`` records exactly them (GPUs only).
            Every phase of a step is an NVTX range on GPUs and a ``record_function`` range in both.
    """

    steps: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=lambda: [0])
    tool: str = "torch"


@dataclass
class CheckpointConfig:
    """``trainer.checkpoint``: how checkpoints are written (when: ``trainer.save_freq``; the seed
    recipe's ``trainer.checkpoint.every_n_steps`` is read as it).

    Attributes:
        async_save: megatron-core's asynchronous distributed-checkpoint save: training stops only
            while each rank's tensors are copied aside; a background process writes them, and the
            checkpoint becomes complete (manifest, rename, ``latest``) at the first step boundary
            after every rank has finished. At most one save is in flight; the run's end waits for it.
        optimizer_format: how the distributed optimizer's Adam state is stored (megatron's formats).
            "dp_reshardable" (default): each rank writes its own shard, no gather; resumes at any
            data- or context-parallel size, at the saved tensor/pipeline/expert layout only.
            "fully_reshardable": gathered over data parallelism and stored per parameter, resumes at
            any layout, at the cost of the whole model-parallel shard's state in every data-parallel
            rank's host memory during the save; refused for models with several gradient buckets
            (a megatron-core 0.16.1 bug, ``engine.trainer.checkpoint``). A checkpoint loads in the
            format it was saved in, whatever this key says.
    """

    async_save: bool = False
    optimizer_format: str = OPTIMIZER_FORMATS[0]


@dataclass
class TrainerConfig:
    """``trainer.*``.

    Attributes:
        project_name, experiment_name: name the run (printed at the start, and part of the default
            run directory).
        device: "auto" (default): the GPUs where CUDA initialises, the CPU on a machine without an
            NVIDIA driver, and a stop with the driver's and torch's CUDA versions where GPUs are
            present but CUDA cannot use them (never a silent fall-back); "cuda": GPUs or stop; "cpu":
            the CPU on purpose, on any machine (``parallel.device``). verl's key; printed at start.
        nnodes: machines in the job; the launch must match (``WORLD_SIZE`` = nnodes x n_gpus_per_node).
        n_gpus_per_node: ranks per machine, one GPU each (CPU processes on a machine without GPUs);
            the launch must match (``LOCAL_WORLD_SIZE``).
        total_epochs: passes over the training prompts.
        total_training_steps: stop after this many PPO iterations; null = ``total_epochs`` worth.
        save_freq: checkpoint every this many iterations; -1 = only at the end.
        test_freq: validate every this many iterations; -1 = never during training.
        val_before_train: validate once before the first iteration.
        val_only: validate the model at ``model.path`` (or the resumed checkpoint) once and stop.
        max_ckpt_to_keep: keep only the newest this-many checkpoints; null keeps all. verl's
            max_actor_ckpt_to_keep / max_critic_ckpt_to_keep are read as it (one checkpoint holds both).
        resume_mode: "auto" resumes from the newest checkpoint in ``default_local_dir`` if any,
            "disable" always starts fresh, "resume_path" resumes from ``resume_from_path``.
        resume_from_path: the checkpoint directory for ``resume_mode=resume_path``.
        default_local_dir: the run directory: checkpoints, logs, the resolved config.
        logger: metric sinks, any of "console", "tensorboard", "jsonl", "wandb", "mlflow" (the last two
            are pip extras: ``pip install 'trident-ppo[wandb]'`` / ``[mlflow]``). wandb runs offline under
            the run directory unless ``WANDB_MODE`` or an API key says otherwise; mlflow logs to
            ``$MLFLOW_TRACKING_URI``, else to ``<run>/mlflow.db``.
        prometheus_port: rank 0 serves the latest step's metrics at ``http://<host>:<port>/metrics``
            (``trident_metric{name="actor/pg_loss"}``) and the SGLang servers export their own;
            null = off.
        profile: see ``ProfileConfig``.
        checkpoint: see ``CheckpointConfig``.
        export_hf_at_end: write the trained actor as a HuggingFace folder (``<run>/hf/actor``,
            with the tokenizer and chat template of ``model.path``) when the run finishes.
        seed: seed of the random streams of the loop: sampling in the embedded engine, the SGLang
            servers' seeds (+ rank), the mini-batch shuffles.
        collective_timeout_minutes: how long a rank waits in a collective (NCCL/gloo) before the
            job fails; covers the slowest step of a 70B run (a checkpoint, a long rollout).
        hang_timeout_minutes: a rank that spends longer than this in one phase of a PPO step (or
            between two) is taken as hung: every rank writes its Python stacks to
            ``<run>/logs/stacks/``, rank 0's terminal names the phase and the ranks that did not
            arrive, and the job ends (``engine.trainer.watchdog``). null = 80% of
            ``collective_timeout_minutes``; 0 = no watchdog.
        max_staleness: 0 = on-policy (each step trains on samples of its own starting weights);
            k >= 1 = k steps off-policy: the rollout servers (``rollout.mode=disaggregated``)
            generate the next k batches while the trainer trains on this one, so step s trains on
            samples of step s - k's weights (``rollout/policy_version``, ``rollout/staleness/*``;
            with ``rollout.partial_rollout`` some tokens come from later weights, none from
            earlier). Batches still generating at a checkpoint are regenerated after a resume.
    """

    project_name: str = "trident"
    experiment_name: str = "default"
    device: str = "auto"
    nnodes: int = 1
    n_gpus_per_node: int = 8
    total_epochs: int = 1
    total_training_steps: int | None = None
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    val_only: bool = False
    max_ckpt_to_keep: int | None = None
    resume_mode: str = "auto"
    resume_from_path: str | None = None
    default_local_dir: str = "runs/${trainer.project_name}/${trainer.experiment_name}"
    logger: list[str] = field(default_factory=lambda: ["console", "tensorboard"])
    export_hf_at_end: bool = True
    seed: int = 1
    collective_timeout_minutes: int = 60
    hang_timeout_minutes: float | None = None
    max_staleness: int = 0
    prometheus_port: int | None = None
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
