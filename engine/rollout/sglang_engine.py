"""Rollout on real SGLang servers: one supervised SGLang server per generation replica.

Requests go out concurrently (one HTTP request per prompt, ``n`` samples each, spread round-robin
over the replicas) so each server can batch them. Weights are pushed bucket by bucket inside a
``/begin_weight_update`` .. ``/end_weight_update`` session, by one of two transports:

- ``"tensor"`` (colocated): ``/update_weights_from_tensor``; each bucket is flattened into one
  buffer and passed by handle (CUDA IPC on GPU, shared memory on CPU), one payload per TP rank. In a
  PPO run every generation rank serializes the bucket it holds itself (``serialize_weights``) and the
  replica's leader sends the payloads in TP order (``push_serialized_weights``), so each SGLang TP
  worker opens a handle into its own GPU's memory (SGLang's ``srt/weight_sync/utils.py``, slime's
  ``update_weight_from_tensor.py``); ``push_weights`` serializes once per TP rank in this process,
  for callers that hold every tensor themselves.
- ``"distributed"`` (servers elsewhere): this process is rank 0 of a weight-update group
  (``/init_weights_update_group``; NCCL on GPU, gloo on CPU) and broadcasts each flattened bucket
  while ``/update_weights_from_distributed`` receives it. A server that rejects the update never
  joins the broadcast, so the broadcast is polled against the HTTP answer and a timeout.
"""
from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import datetime
import functools
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from engine.config.actor_rollout_ref import RolloutConfig
from engine.models.lora import LoRASettings
from engine.rollout.base import (
    MEMORY_TAGS,
    PauseMode,
    RolloutEngine,
    RolloutError,
    RolloutSample,
    RolloutServerDied,
    SamplingParams,
    WeightUpdateError,
    check_memory_tags,
    check_pause_mode,
    validate_prompts,
)
from engine.rollout.sglang_cpu import memory_occupation_control_supported
from engine.rollout.sglang_presharded import LOADER as PRESHARDED_LOADER
from engine.rollout.sglang_server import (SGLangServer, SGLangServerConfig, SGLangServerCrashed, feature_args,
                                          wait_reporting)
from engine.rollout.shared_memory import use_file_system_sharing
from parallel.state import find_free_port

logger = logging.getLogger(__name__)

WeightTransport = Literal["tensor", "distributed"]
# The name the servers hold the pushed LoRA adapters under (``push_adapters``).
ADAPTER_NAME = "trident-actor"


@dataclasses.dataclass
class SGLangRolloutConfig:
    """How this process starts and drives its SGLang servers (the user's settings are ``rollout``)."""

    # HF model folder the servers load at start-up (later weights arrive by push).
    model_path: str
    # Server logs go here: sglang_replica{i}.log
    run_dir: str
    # actor_rollout_ref.rollout: generation TP, dtype, memory fraction, mode, timeouts.
    rollout: RolloutConfig
    # One server per entry: the node-local GPU ids of its TP ranks, in TP order (see
    # HybridLayout.replica_placements); () = SGLang's default devices (GPUs 0.., or the CPU).
    replica_gpus: tuple[tuple[int, ...], ...] = ((),)
    context_length: int | None = None
    max_total_tokens: int | None = None
    weight_transport: WeightTransport = "tensor"
    host: str = "127.0.0.1"
    # Address the servers use to reach this process for the distributed weight-update group.
    weight_update_master_address: str = "127.0.0.1"
    max_concurrent_requests: int = 256
    # Servers another process started and owns (disaggregated mode: the weight senders of pipeline
    # stages > 0), as "host:port"; this engine then only pushes weights into the owner's session
    # (the owner opens and closes it; the trainer orders the two with barriers).
    attach_to: tuple[str, ...] = ()
    # Servers a launcher started on nodes of their own ("host:port", ``launch.rollout_servers``):
    # this engine drives them like its own (weight-update sessions, cache flushes) but neither
    # starts nor stops them.
    external_servers: tuple[str, ...] = ()
    # The key those servers require (``rollout.server_addresses``); never logged.
    api_key: str | None = dataclasses.field(default=None, repr=False)
    # Index of this engine's first server among the job's (its log is sglang_replica{index}.log).
    first_replica_index: int = 0
    random_seed: int | None = None
    trust_remote_code: bool = False
    extra_server_args: tuple[str, ...] = ()
    # MoE: ask the servers for the experts each token was routed to (--enable-return-routed-experts;
    # the actor replays them, ``actor.megatron.moe_router_replay``).
    return_routed_experts: bool = False
    # ``rollout.lora_sync=adapters``: the servers start with LoRA enabled for these adapters and
    # take them with ``push_adapters`` (None: no LoRA in the servers).
    lora: LoRASettings | None = None

    def __post_init__(self) -> None:
        tp = self.rollout.tensor_model_parallel_size
        self.attach_to, self.external_servers = tuple(self.attach_to), tuple(self.external_servers)
        if self.attach_to and self.external_servers:
            raise ValueError("SGLangRolloutConfig: attach_to and external_servers exclude each other")
        # Servers this engine does not start are placed by whoever started them.
        running = self.attach_to or self.external_servers
        self.replica_gpus = ((),) * len(running) if running else tuple(tuple(g) for g in self.replica_gpus)
        if not self.replica_gpus:
            raise ValueError("SGLangRolloutConfig.replica_gpus must name at least one replica")
        for gpus in self.replica_gpus:
            if gpus and len(gpus) != tp:
                raise ValueError(f"SGLangRolloutConfig.replica_gpus entry {gpus} must hold "
                                 f"rollout.tensor_model_parallel_size={tp} GPUs")
        used = [gpu for gpus in self.replica_gpus for gpu in gpus]
        if len(used) != len(set(used)):
            raise ValueError(f"SGLangRolloutConfig.replica_gpus={self.replica_gpus} gives a GPU to two servers")
        if self.weight_transport not in ("tensor", "distributed"):
            raise ValueError(f"SGLangRolloutConfig.weight_transport={self.weight_transport!r} must be 'tensor' or 'distributed'")


def serialize_weights(named_tensors: Sequence[tuple[str, torch.Tensor]], *,
                      presharded: bool = False) -> tuple[str, torch.Tensor]:
    """One ``/update_weights_from_tensor`` payload of ``named_tensors``, made by this process: the
    tensors flattened into one fresh buffer (bounded by the bucket size: the caller's tensors are never
    moved into shared memory) and passed by handle, a CUDA IPC handle into this process's GPU memory
    or, on CPU, a shared-memory file this process created. Returns the payload and the buffer, which
    must stay alive until the server has loaded it. ``presharded``: a TP rank's own shards for the
    presharded loader, which takes (name, tensor) pairs: views into the one buffer, one handle."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket(named_tensors=[(name, t.detach().contiguous()) for name, t in named_tensors])
    flat = bucket.get_flattened_tensor()
    if flat.device.type == "cpu":
        use_file_system_sharing()  # CPU tensors travel as shared-memory files (engine.rollout.shared_memory)
    else:
        # CUDA IPC handles name the device by index, and the server sees other indices (its
        # CUDA_VISIBLE_DEVICES holds only its replica's GPUs): SGLang's patch sends the device's
        # UUID instead; its scheduler applies the same patch on the receiving side.
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
    payload = {"flattened_tensor": flat, "metadata": bucket.get_metadata()}
    if presharded:
        payload = bucket.reconstruct_tensors()
    return MultiprocessingSerializer.serialize(payload, output_str=True), flat


def checkpoint_tensor_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of the safetensors checkpoint in ``model_path``."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def _sglang_sampling_params(params: SamplingParams) -> dict[str, Any]:
    # Every knob explicit: SGLang would otherwise fill unset ones from the model's generation_config.
    return {
        "max_new_tokens": params.max_new_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": params.top_k,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "n": params.n,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
    }


@dataclasses.dataclass(frozen=True)
class RoutedExpertsLayout:
    """How SGLang reports routed experts: ``meta_info["routed_experts"]`` is base64 of int32
    ``[prompt + output tokens - 1, every decoder layer, top-k]`` (``sglang/srt/state_capturer/
    routed_experts.py``, ``extract_routed_experts_from_meta_info``); Trident keeps the MoE layers."""

    num_layers: int
    topk: int
    moe_layers: tuple[int, ...]

    @classmethod
    def of_model(cls, model_path: str) -> "RoutedExpertsLayout":
        from engine.models.hf_config import architecture_from_hf

        architecture = architecture_from_hf(model_path)
        if architecture.moe is None:
            raise RolloutError(f"routed experts asked of SGLang for {model_path}, a dense model")
        return cls(architecture.num_layers, architecture.moe.topk, tuple(architecture.moe.layers))

    def decode(self, encoded: str, tokens: int) -> torch.Tensor:
        """``[tokens - 1, MoE layers, k]`` int16 of one response (``tokens``: prompt + output)."""
        flat = torch.from_numpy(np.frombuffer(base64.b64decode(encoded), dtype=np.int32).copy())
        if flat.numel() != (tokens - 1) * self.num_layers * self.topk:
            raise RolloutError(f"SGLang reported {flat.numel()} routed-expert ids for {tokens} tokens, expected "
                               f"({tokens} - 1) x {self.num_layers} layers x top-{self.topk}")
        return flat.view(tokens - 1, self.num_layers, self.topk)[:, list(self.moe_layers)].to(torch.int16)


def _parse_sample(item: dict[str, Any], prompt_length: int, routed_layout: RoutedExpertsLayout | None) -> RolloutSample:
    meta = item["meta_info"]
    token_ids = [int(t) for t in item["output_ids"]]
    log_probs = [lp for lp, _token, _text in meta.get("output_token_logprobs") or []]
    if None in log_probs:  # JSON has no NaN or infinity: the server sends null for them
        raise RolloutError(f"SGLang returned a non-finite log-prob (null) for output token {log_probs.index(None)} "
                           f"of {len(log_probs)}: the served weights or the sampler produced NaN or inf")
    log_probs = [float(lp) for lp in log_probs]
    # An aborted request can report fewer log-probs than tokens; keep the aligned prefix.
    length = min(len(token_ids), len(log_probs))
    reason = (meta.get("finish_reason") or {}).get("type", "abort")
    if reason not in ("stop", "length", "abort"):
        raise RolloutError(f"SGLang returned an unknown finish reason {meta.get('finish_reason')!r}")
    versions = None
    if meta.get("weight_versions"):
        versions = _token_versions(meta["weight_versions"], len(token_ids))
    routed = None
    if routed_layout is not None and meta.get("routed_experts"):
        routed = routed_layout.decode(meta["routed_experts"], prompt_length + len(token_ids))
        routed = routed[:prompt_length + length - 1]
    elif routed_layout is not None and reason != "abort":
        raise RolloutError("SGLang returned no routed experts (was it started with --enable-return-routed-experts?)")
    # An abort before the request ran comes without them (sglang scheduler.py send_abort_output builds
    # no routed_experts): its tokens' rows stay unreported (-1), and the trainer routes them itself.
    return RolloutSample(token_ids[:length], log_probs[:length], reason, routed_experts=routed,
                         policy_versions=None if versions is None else versions[:length])


def _token_versions(spans: list[dict[str, Any]], num_tokens: int) -> list[int] | None:
    """Each output token's weight version from SGLang's ``meta_info["weight_versions"]`` spans
    (``[{"version", "start", "end"}]``, ``sglang/srt/utils/weight_versions.py``); None while a
    span has a version Trident did not set (the checkpoint's own, "default")."""
    versions: list[int] = []
    for span in spans:
        if not str(span["version"]).isdigit():
            return None
        versions += [int(span["version"])] * (int(span["end"]) - int(span["start"]))
    if len(versions) != num_tokens:
        raise RolloutError(f"SGLang's weight-version spans {spans} cover {len(versions)} of {num_tokens} output tokens")
    return versions


class SGLangRolloutEngine(RolloutEngine):
    """Rollout on SGLang servers (one per ``replica_gpus`` entry) started and supervised by this object."""

    concurrent_requests = True  # each request is an HTTP call of its own; the servers batch them

    def __init__(self, config: SGLangRolloutConfig):
        self.config = config
        # May be switched between sessions (e.g. tensor pushes locally, distributed to remote servers).
        self.weight_transport: WeightTransport = config.weight_transport
        self.tensor_shapes = checkpoint_tensor_shapes(config.model_path)
        self._routed_layout = RoutedExpertsLayout.of_model(config.model_path) if config.return_routed_experts else None
        run_dir = Path(config.run_dir)
        running = config.attach_to or config.external_servers
        addresses = [address.rsplit(":", 1) for address in running] or [(config.host, None)] * len(config.replica_gpus)
        # The owner of the servers' weight-update sessions (not of their processes, for external ones).
        self.owns_servers = not config.attach_to
        # Whether this engine started its servers' processes, and so how many times it may restart them.
        self.owns_processes = not running
        self.max_restarts = config.rollout.max_server_restarts if self.owns_processes else 0
        self.servers = [
            (functools.partial(SGLangServer.attach, external=bool(config.external_servers)) if running else SGLangServer)(
                SGLangServerConfig(
                    model_path=config.model_path,
                    log_path=run_dir / f"sglang_replica{config.first_replica_index + i}.log",
                    rollout=config.rollout,
                    host=host,
                    port=None if port is None else int(port),
                    gpu_ids=gpus,
                    context_length=config.context_length,
                    max_total_tokens=config.max_total_tokens,
                    random_seed=config.random_seed,
                    trust_remote_code=config.trust_remote_code,
                    extra_args=tuple(config.extra_server_args) + feature_args(
                        config.rollout, config.return_routed_experts, config.lora),
                    api_key=config.api_key,
                )
            )
            for i, ((host, port), gpus) in enumerate(zip(addresses, config.replica_gpus))
        ]
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=config.max_concurrent_requests, thread_name_prefix="sglang-generate")
        # Control requests (pause, weights, health) get their own threads: a pause must not queue
        # behind the generate requests it is meant to abort.
        self._control_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2 * len(config.replica_gpus), thread_name_prefix="sglang-control")
        self._weight_update_group: Any = None
        self._weight_update_group_name = ""
        self._in_weight_update = False
        self._session_transport: WeightTransport | None = None
        # Servers that died and will be restarted (rollout.max_server_restarts), by index, with the
        # error that showed it; a weight-update session that lost a server pushes nothing more.
        self.dead: dict[int, SGLangServerCrashed] = {}
        self.restarts = 0
        self._session_lost_a_server = False
        # The servers (by index) that hold the pushed LoRA adapters; generation names them.
        self._adapter_servers: set[int] = set()
        self._closed = False
        try:
            for server in self.servers:
                server.start()
            for server in self.servers:
                server.wait_until_ready()
        except BaseException:
            self.shutdown()
            raise

    # ----------------------------------------------------------------------------- helpers

    def _live_servers(self) -> list[tuple[int, SGLangServer]]:
        return [(index, server) for index, server in enumerate(self.servers) if index not in self.dead]

    def _on_all_servers(self, path: str, payload: dict[str, Any] | None = None,
                        timeout: float | None = None) -> dict[int, Any]:
        """``path`` on every live server; their answers by server index (a server found dead is
        recorded for a restart, or its crash raised)."""
        futures = {index: self._control_pool.submit(server.post, path, payload, timeout)
                   for index, server in self._live_servers()}
        wait_reporting(futures.values(), lambda done: f"{path} on {len(futures) - done} of {len(futures)} SGLang "
                                                      f"server(s) ({', '.join(s.url for s in self.servers)})")
        return self._answers(futures)

    def _answers(self, futures: dict[int, concurrent.futures.Future]) -> dict[int, Any]:
        """The answers of the servers that answered, by index; a server found dead is recorded for a
        restart (or its crash raised, ``_server_died``)."""
        answers = {}
        for index, future in futures.items():
            try:
                answers[index] = future.result()
            except SGLangServerCrashed as error:
                self._server_died(index, error)
        return answers

    def _server_died(self, index: int, error: SGLangServerCrashed) -> None:
        """Record a dead server for ``restart_dead_servers``, or raise its crash when it may not be
        restarted: another process owns it (a server this engine attached to, or one of
        ``rollout.server_addresses``), or the run has used up ``rollout.max_server_restarts``."""
        limit = self.max_restarts
        if self.restarts + len(self.dead) >= limit:
            if limit:
                raise SGLangServerCrashed(f"{error} (restarted {self.restarts} time(s) already: "
                                          f"actor_rollout_ref.rollout.max_server_restarts={limit})") from error
            raise error
        logger.warning("SGLang server %s died; it will be restarted: %s", self.servers[index].url, error)
        self.dead[index] = error
        self._session_lost_a_server = self._in_weight_update

    def _check_success(self, path: str, answers: dict[int, Any]) -> None:
        for index, answer in answers.items():
            if isinstance(answer, dict) and answer.get("success") is False:
                raise WeightUpdateError(f"SGLang server {self.servers[index].url} rejected {path}: {answer.get('message')}")

    def _weight_request_on_all_servers(self, path: str, payload: dict[str, Any]) -> None:
        """A weight-update request; a refusal (HTTP 400 or success=false) is a WeightUpdateError."""
        try:
            answers = self._on_all_servers(path, payload, self.config.rollout.weight_update_timeout_s)
        except SGLangServerCrashed:
            raise
        except RolloutError as error:
            raise WeightUpdateError(str(error)) from error
        self._check_success(path, answers)

    # ----------------------------------------------------------------------------- generation

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling_params: SamplingParams) -> list[list[RolloutSample]]:
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        prompts = validate_prompts(prompt_token_ids)
        if self._in_weight_update:
            raise RolloutError("generate() called inside a weight-update session; call end_weight_update() first")
        sampling = _sglang_sampling_params(sampling_params)
        live = [index for index, _ in self._live_servers()]
        if not live:
            raise RolloutServerDied("every SGLang server of this engine is down", completed={})
        targets = [live[i % len(live)] for i in range(len(prompts))]
        futures = [
            self._pool.submit(
                self.servers[target].post,
                "/generate",
                {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True,
                 **({"return_routed_experts": True} if self._routed_layout is not None else {}),
                 **({"lora_path": ADAPTER_NAME} if target in self._adapter_servers else {})},
                self.config.rollout.request_timeout_s,
            )
            for target, prompt in zip(targets, prompts)
        ]
        wait_reporting(futures, lambda done: f"{len(prompts) - done} of {len(prompts)} responses from SGLang "
                                             f"server(s) {', '.join(self.servers[i].url for i in live)}")
        results: dict[int, list[RolloutSample]] = {}
        for i, (target, future) in enumerate(zip(targets, futures)):
            try:
                answer = future.result()
            except SGLangServerCrashed as error:
                if target not in self.dead:
                    self._server_died(target, error)
                continue
            items = answer if isinstance(answer, list) else [answer]
            if len(items) != sampling_params.n:
                raise RolloutError(f"SGLang returned {len(items)} samples for a prompt, expected n={sampling_params.n}")
            results[i] = [_parse_sample(item, len(prompts[i]), self._routed_layout) for item in items]
        if len(results) < len(prompts):
            raise RolloutServerDied(f"{len(prompts) - len(results)} of {len(prompts)} prompts were lost with SGLang "
                                    f"server(s) {', '.join(self.servers[i].url for i in self.dead)}", completed=results)
        return [results[i] for i in range(len(prompts))]

    # ----------------------------------------------------------------------------- weights

    def _validate_bucket(self, named_shapes: Sequence[tuple[str, Sequence[int]]]) -> None:
        # A name the model lacks would make SGLang's loader raise inside the scheduler: check here.
        for name, shape in named_shapes:
            expected = self.tensor_shapes.get(name)
            if expected is None:
                raise WeightUpdateError(f"weight {name!r} is not in the checkpoint of {self.config.model_path}")
            if tuple(shape) != expected:
                raise WeightUpdateError(f"weight {name!r} has shape {tuple(shape)}, the checkpoint has {expected}")

    def begin_weight_update(self) -> None:
        if self._in_weight_update:
            raise WeightUpdateError("a weight-update session is already open; call end_weight_update() first")
        self._in_weight_update, self._session_lost_a_server = True, bool(self.dead)
        self._session_transport = self.weight_transport
        self._unload_adapters()  # the merged weights being pushed hold them
        if self.weight_transport == "distributed" and self._weight_update_group is None and not self.dead:
            self._init_weight_update_group()
        if self.owns_servers:
            self._weight_request_on_all_servers("/begin_weight_update", {})

    def push_adapters(self, tensors: dict[str, torch.Tensor], peft_config: dict) -> None:
        """SGLang's ``/load_lora_adapter_from_tensors`` on every server, after unloading the adapters
        pushed before. The tensors travel by handle as host shared memory, one payload per TP rank
        (each TP worker opens its own; SGLang slices the adapters for its rank)."""
        from sglang.srt.utils import MultiprocessingSerializer

        if self.config.lora is None:
            raise WeightUpdateError("push_adapters(): these SGLang servers were started without LoRA "
                                    "(SGLangRolloutConfig.lora)")
        self._unload_adapters()
        use_file_system_sharing()  # as serialize_weights, for CPU tensors
        host = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
        payloads = [MultiprocessingSerializer.serialize(host, output_str=True)
                    for _ in range(self.config.rollout.tensor_model_parallel_size)]
        self._weight_request_on_all_servers("/load_lora_adapter_from_tensors", {
            "lora_name": ADAPTER_NAME, "config_dict": peft_config, "serialized_named_tensors": payloads})
        self._adapter_servers = {index for index, _ in self._live_servers()}
        del host  # the servers have copied them

    def _unload_adapters(self) -> None:
        if self._adapter_servers & {index for index, _ in self._live_servers()}:
            self._weight_request_on_all_servers("/unload_lora_adapter", {"lora_name": ADAPTER_NAME})
        self._adapter_servers = set()

    def push_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        if not self._in_weight_update:
            raise WeightUpdateError("push_weights() outside a session; call begin_weight_update() first")
        named_tensors = list(named_tensors)
        if not named_tensors or self._session_lost_a_server:  # the sync after the restart pushes everything
            return
        self._validate_bucket([(name, tensor.shape) for name, tensor in named_tensors])
        if self._session_transport == "tensor":
            self._push_by_tensor_handles(named_tensors)
        else:
            self._push_by_broadcast(named_tensors)

    def _push_by_tensor_handles(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        # One serialization per TP rank: each rank must open its own handle (CUDA IPC refcounts).
        payloads, flats = zip(*(serialize_weights(named_tensors) for _ in range(self.config.rollout.tensor_model_parallel_size)))
        self._post_payloads(list(payloads))
        del flats  # the servers have loaded them

    def push_serialized_weights(self, named_shapes: Sequence[tuple[str, tuple[int, ...]]], payloads: Sequence[str], *,
                                presharded: bool = False) -> None:
        """Push one bucket that every TP rank of the replica serialized itself (``serialize_weights``):
        ``payloads[g]`` goes to the server's TP rank g. ``named_shapes``: the bucket's tensors and
        their whole shapes, checked against the checkpoint as ``push_weights`` checks them.
        ``presharded``: each payload holds its rank's shards, which the presharded loader copies into
        place (``engine.rollout.sglang_presharded``). The payloads' tensors must stay alive in their
        processes until this returns."""
        if not self._in_weight_update or self._session_transport != "tensor":
            raise WeightUpdateError("push_serialized_weights() outside a tensor-transport weight-update session")
        if len(payloads) != self.config.rollout.tensor_model_parallel_size:
            raise WeightUpdateError(f"{len(payloads)} payloads for a server of "
                                    f"tensor_model_parallel_size={self.config.rollout.tensor_model_parallel_size}")
        self._validate_bucket(named_shapes)
        if not self._session_lost_a_server:
            self._post_payloads(list(payloads), PRESHARDED_LOADER if presharded else "flattened_bucket")

    def _post_payloads(self, payloads: list[str], load_format: str = "flattened_bucket") -> None:
        request = {"serialized_named_tensors": payloads, "load_format": load_format, "flush_cache": False}
        self._weight_request_on_all_servers("/update_weights_from_tensor", request)

    def _init_weight_update_group(self) -> None:
        from sglang.srt.utils import init_custom_process_group

        tp = self.config.rollout.tensor_model_parallel_size
        world_size = 1 + len(self.servers) * tp
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        address = self.config.weight_update_master_address
        port = find_free_port(address)
        timeout_s = self.config.rollout.weight_update_timeout_s
        # A fresh name per group: torch refuses to register a name twice, and an abandoned group
        # (see _abandon_weight_update_group) stays registered in this process.
        group_name = f"trident_weight_update_{uuid.uuid4().hex[:8]}"
        futures = {
            i: self._control_pool.submit(
                server.post,
                "/init_weights_update_group",
                {
                    "master_address": address,
                    "master_port": port,
                    "rank_offset": 1 + i * tp,
                    "world_size": world_size,
                    "group_name": group_name,
                    "backend": backend,
                },
                timeout_s,
            )
            for i, server in enumerate(self.servers)
        }
        joined: dict[str, Any] = {}

        def join_group() -> None:
            try:
                joined["group"] = init_custom_process_group(
                    backend=backend, init_method=f"tcp://{address}:{port}", world_size=world_size, rank=0,
                    group_name=group_name, timeout=datetime.timedelta(seconds=timeout_s))
            except BaseException as error:  # re-raised below, in the caller's thread
                joined["error"] = error

        # The rendezvous runs beside the requests: a server that refuses them (a wrong API key, a dead
        # process) never joins, and its answer, not the rendezvous timeout, ends the wait. A daemon
        # thread, so a rendezvous left waiting then cannot hold the process at exit.
        joiner = threading.Thread(target=join_group, name="weight-update-group", daemon=True)
        joiner.start()
        answers = self._answers(futures)
        if self.dead:
            return  # no group without it: the session pushes nothing, the restart's sync forms a new one
        self._check_success("/init_weights_update_group", answers)
        joiner.join(timeout_s)
        if joiner.is_alive():
            raise WeightUpdateError(f"the weight-update group at {address}:{port} did not form within {timeout_s:.0f}s "
                                    f"(actor_rollout_ref.rollout.weight_update_timeout_s)")
        if "error" in joined:
            raise joined["error"]
        self._weight_update_group, self._weight_update_group_name = joined["group"], group_name

    def _push_by_broadcast(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        device = "cuda" if torch.cuda.is_available() else "cpu"
        bucket = FlattenedTensorBucket(named_tensors=[(name, t.detach().to(device).contiguous()) for name, t in named_tensors])
        request = {
            "names": [name for name, _ in named_tensors],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named_tensors],
            "shapes": [list(t.shape) for _, t in named_tensors],
            "group_name": self._weight_update_group_name,
            "load_format": "flattened_bucket",
            "flush_cache": False,
        }
        timeout = self.config.rollout.weight_update_timeout_s
        answers = {index: self._control_pool.submit(server.post, "/update_weights_from_distributed", request, timeout)
                   for index, server in self._live_servers()}
        work = torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=self._weight_update_group, async_op=True)
        deadline = time.monotonic() + timeout
        while not work.is_completed():
            # A server that refused the request (or died) will never join this broadcast.
            for index, answer in answers.items():
                if answer.done() and (answer.exception() is not None or answer.result().get("success") is False):
                    self._abandon_weight_update_group()
                    error = answer.exception()
                    if isinstance(error, SGLangServerCrashed):
                        self._server_died(index, error)  # the session pushes nothing more; the restart re-syncs
                        return
                    message = error if error is not None else answer.result().get("message")
                    raise WeightUpdateError(f"distributed weight update rejected: {message}")
            if time.monotonic() > deadline:
                self._abandon_weight_update_group()
                raise WeightUpdateError(f"distributed weight broadcast did not complete within {timeout:.0f}s "
                                        "(actor_rollout_ref.rollout.weight_update_timeout_s)")
            time.sleep(0.001)
        work.wait()
        self._check_success("/update_weights_from_distributed",
                            {index: answer.result(timeout=timeout) for index, answer in answers.items()})

    def _abandon_weight_update_group(self) -> None:
        # A broadcast left half-done poisons the group; the next distributed session builds a new one.
        self._weight_update_group = None
        for _, server in self._live_servers():
            try:
                server.post("/destroy_weights_update_group", {"group_name": self._weight_update_group_name}, timeout=30)
            except RolloutError as error:
                logger.warning("could not destroy the weight-update group on %s: %s", server.url, error)

    def end_weight_update(self) -> None:
        if not self._in_weight_update:
            raise WeightUpdateError("end_weight_update() without begin_weight_update()")
        self._in_weight_update = False
        if not self.owns_servers:
            return
        self._weight_request_on_all_servers("/end_weight_update", {})
        # Drop radix-cache prefixes computed with the old weights. SGLang refuses while requests
        # are still running (pause mode "in_place"): those keep their old KV by design.
        for index, server in self._live_servers():
            try:
                server.post("/flush_cache", {}, timeout=self.config.rollout.weight_update_timeout_s)
            except SGLangServerCrashed as error:
                self._server_died(index, error)
            except RolloutError as error:
                logger.warning("cache not flushed after the weight update on %s: %s", server.url, error)

    # ----------------------------------------------------------------------------- lifecycle

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        tags = check_memory_tags(tags)
        if memory_occupation_control_supported():  # a no-op on CPU (see engine.rollout.sglang_cpu)
            self._on_all_servers("/release_memory_occupation", {"tags": list(tags)})

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        tags = check_memory_tags(tags)
        if memory_occupation_control_supported():
            self._on_all_servers("/resume_memory_occupation", {"tags": list(tags)})

    def set_weight_version(self, version: int) -> None:
        """Every server tags the tokens it samples from now on with ``version`` (a generation paused
        in place for the push keeps its earlier tokens' version: ``RolloutSample.policy_versions``)."""
        if self.owns_servers:
            self._on_all_servers("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})

    def pause_generation(self, mode: PauseMode = "abort") -> None:
        check_pause_mode(mode)
        self._on_all_servers("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._on_all_servers("/continue_generation", {})

    def health(self) -> bool:
        return all(server.is_healthy() for server in self.servers)

    def dead_servers(self) -> int:
        return len(self.dead)

    def restart_dead_servers(self) -> int:
        """Restart the dead servers (one at a time, each on its own GPUs and port); the caller pushes
        the current weights next (``servers_restarted`` on every engine first)."""
        restarted = sorted(self.dead)
        for index in restarted:
            server = self.servers[index]
            logger.warning("restarting SGLang server %s (restart %d of actor_rollout_ref.rollout.max_server_restarts=%d)",
                           server.url, self.restarts + 1, self.max_restarts)
            server.restart()
            del self.dead[index]
            self._adapter_servers.discard(index)  # it serves its start-up weights alone
            self.restarts += 1
        return len(restarted)

    def servers_restarted(self) -> None:
        # A broadcast group that held a restarted server is gone; the next session forms a new one
        # (on the owner and on the pipeline stages' senders that attach to its servers alike).
        if self._weight_update_group is not None:
            self._abandon_weight_update_group()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._weight_update_group is not None:
            try:
                torch.distributed.destroy_process_group(self._weight_update_group)
            except Exception as error:  # the servers may already be gone
                logger.warning("destroying the weight-update group failed: %s", error)
            self._weight_update_group = None
        for server in self.servers:
            server.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._control_pool.shutdown(wait=False, cancel_futures=True)
