"""Embedded rollout engine: transformers' ``generate`` over an HF-format model, in this process.

The default on CPU. Batched and KV-cached (``model.generate`` with left padding); the sampling rule
and the log-prob definition are SGLang's (see ``engine/rollout/base.py``), implemented by one
logits processor that both filters the distribution and records the log-prob of each sampled token.
For MoE models it also records the experts every token was routed to while generating
(``RolloutSample.routed_experts``), from forward hooks on transformers' routers.
"""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import torch
import transformers

from engine.config.actor_rollout_ref import RolloutConfig
from engine.models.weight_mapping import transformers_in_memory_slot
from engine.rollout.base import (
    MEMORY_TAGS,
    WEIGHTS,
    PauseMode,
    RolloutEngine,
    RolloutError,
    RolloutSample,
    SamplingParams,
    WeightUpdateError,
    check_memory_tags,
    check_pause_mode,
    validate_prompts,
)
from parallel.cpu_compat import without_device_rewriting


def model_eos_token_ids(model_config: transformers.PretrainedConfig, generation_config: transformers.GenerationConfig | None) -> set[int]:
    """EOS ids the way SGLang collects them: config.json's eos_token_id plus generation_config's."""
    eos: set[int] = set()
    for source in (model_config, generation_config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        eos.update([value] if isinstance(value, int) else value)
    return eos


def keep_mask_top_k_top_p(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Boolean mask of the tokens SGLang may sample: rank < top_k and the mass ranked above <= top_p.

    ``probs``: (rows, vocab) of the temperature-scaled distribution.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = mass_above <= top_p
    if top_k != -1:
        keep_sorted[:, top_k:] = False
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


class _SGLangSamplingProcessor(transformers.LogitsProcessor):
    """Turns raw logits into SGLang's sampling distribution and records sampled-token log-probs.

    Called once per step with the logits for the next token; the token drawn at step t is visible
    at step t+1 (last column of ``input_ids``), so its log-prob is read then from the stored row.
    Only one step of log-probs is kept, not the whole (rows, steps, vocab) tensor.
    """

    def __init__(self, params: SamplingParams):
        self.params = params
        self.token_log_probs: list[torch.Tensor] = []
        self._previous_log_probs: torch.Tensor | None = None

    def _record(self, sampled: torch.Tensor) -> None:
        if self._previous_log_probs is not None:
            self.token_log_probs.append(self._previous_log_probs.gather(1, sampled.view(-1, 1)).squeeze(1))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._record(input_ids[:, -1])
        scaled = scores.float() / self.params.log_prob_temperature
        self._previous_log_probs = torch.log_softmax(scaled, dim=-1)
        if self.params.is_greedy or (self.params.top_k == -1 and self.params.top_p >= 1.0):
            return scaled
        keep = keep_mask_top_k_top_p(self._previous_log_probs.exp(), self.params.top_k, self.params.top_p)
        return scaled.masked_fill(~keep, float("-inf"))

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """(rows, steps) log-probs once generation has returned its final tokens."""
        self._record(last_tokens)
        return torch.stack(self.token_log_probs, dim=1)


class _PauseCriteria(transformers.StoppingCriteria):
    """Ends every row when the engine was paused with ``abort``; waits while paused in place."""

    def __init__(self, engine: "TorchRolloutEngine", epoch: int):
        self.engine = engine
        self.epoch = epoch

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        aborted = self.engine._abort_epoch != self.epoch
        if not aborted:
            self.engine._not_paused.wait()
            aborted = self.engine._abort_epoch != self.epoch
        return torch.full((input_ids.shape[0],), aborted, dtype=torch.bool, device=input_ids.device)


class _RoutingRecorder:
    """The top-k expert indices transformers' MoE routers (``*TopKRouter``, which return logits,
    weights and indices) pick in each forward of one ``generate`` call: the prefill over the padded
    prompts, then one position per decoding step."""

    def __init__(self, model: torch.nn.Module, rows: int) -> None:
        self.rows = rows
        routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        self.steps: list[list[torch.Tensor]] = [[] for _ in routers]
        self._handles = [router.register_forward_hook(self._hook(layer)) for layer, router in enumerate(routers)]

    def _hook(self, layer: int):
        def record(module, args, output) -> None:
            indices = output[2]
            self.steps[layer].append(indices.reshape(self.rows, -1, indices.shape[-1]).to("cpu", torch.int16))
        return record

    def close(self) -> torch.Tensor | None:
        """``[rows, positions fed, MoE layers, k]``, None for a dense model."""
        for handle in self._handles:
            handle.remove()
        if not self.steps or not self.steps[0]:
            return None
        return torch.stack([torch.cat(layer, dim=1) for layer in self.steps], dim=2)


def _return_freed_heap_to_the_os() -> None:
    """glibc keeps freed heap blocks for reuse (blocks under its adaptive mmap threshold, up to 32 MiB,
    live on the heap), so freed CPU tensors may not leave the process; ``malloc_trim`` returns them."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass


class TorchRolloutEngine(RolloutEngine):
    """Rollout with transformers' ``generate`` on a model held in this process.

    Args:
        model_path: HF model folder (config.json + safetensors).
        rollout: ``actor_rollout_ref.rollout``: the engine serves ``rollout.dtype``.
        device: None: "cuda" (this rank's GPU) when a GPU is present, else "cpu".
        max_batch_size: rows (prompt x sample) per ``model.generate`` call.
        pad_token_id: the left-padding id; None: the model's pad_token_id, else 0 (padding is
            masked, any id works).
        trust_remote_code: ``model.trust_remote_code``.
        lora: the actor's ``LoRASettings`` with ``rollout.lora_sync=adapters`` (``push_adapters``).
    """

    def __init__(self, model_path: str, rollout: RolloutConfig, *, device: str | None = None, max_batch_size: int = 64,
                 pad_token_id: int | None = None, trust_remote_code: bool = False, lora=None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        self.max_batch_size = max_batch_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = getattr(torch, rollout.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"actor_rollout_ref.rollout.dtype={rollout.dtype!r} is not a torch dtype name")
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, trust_remote_code=trust_remote_code).to(self.device)
        self.model.eval()
        self.eos_token_ids = model_eos_token_ids(self.model.config, self.model.generation_config)
        # Sampling comes only from SamplingParams: the checkpoint's generation defaults (top_k=50,
        # repetition penalties, ...) would otherwise fill every field we leave unset.
        self.model.generation_config = transformers.GenerationConfig()
        self.vocab_size = self.model.config.vocab_size
        pad = pad_token_id if pad_token_id is not None else self.model.config.pad_token_id
        self.pad_token_id = 0 if pad is None else int(pad)
        # Every name a pushed tensor may carry, tied aliases included (lm_head.weight -> embed).
        self._named_state = self.model.state_dict(keep_vars=True)
        self._not_paused = threading.Event()
        self._not_paused.set()
        self._abort_epoch = 0
        self._in_weight_update = False
        self._released: set[str] = set()  # memory tags given back by release_memory
        self._released_shapes: dict[str, torch.Size] = {}
        # LoRA (``lora``, rollout.lora_sync=adapters): PEFT's layers around the model's from the start
        # (B = 0: the base model until the first ``push_adapters``); their config while they serve,
        # and the base weights kept in host memory while released (no push brings them back).
        self._adapter_config: dict | None = None
        self._host_weights: dict[str, torch.Tensor] = {}
        if lora is not None:
            import peft

            self._adapter_config = lora.peft_config()
            self.model = peft.get_peft_model(self.model, peft.get_peft_config(dict(self._adapter_config)))
            self.model.eval()

    # ----------------------------------------------------------------------------- generation

    @torch.no_grad()
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling_params: SamplingParams) -> list[list[RolloutSample]]:
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        prompts = validate_prompts(prompt_token_ids, self.vocab_size)
        if self._in_weight_update:
            raise RolloutError("generate() called inside a weight-update session; call end_weight_update() first")
        if self._released:
            raise RolloutError(f"generate() called while {sorted(self._released)} are released; "
                               "call resume_memory() (and push the weights) first")
        self._not_paused.wait()
        epoch = self._abort_epoch
        rows = [prompt for prompt in prompts for _ in range(sampling_params.n)]
        samples: list[RolloutSample] = []
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start : start + self.max_batch_size]
            if self._abort_epoch != epoch:
                samples.extend(RolloutSample([], [], "abort") for _ in chunk)
            else:
                samples.extend(self._generate_chunk(chunk, sampling_params, epoch))
        n = sampling_params.n
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate_chunk(self, rows: list[list[int]], params: SamplingParams, epoch: int) -> list[RolloutSample]:
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row) :] = torch.tensor(row)
            attention_mask[i, width - len(row) :] = 1
        stop_ids = set() if params.ignore_eos else self.eos_token_ids | set(params.stop_token_ids)
        processor = _SGLangSamplingProcessor(params)
        generation_config = transformers.GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=0,
            do_sample=not params.is_greedy,
            eos_token_id=sorted(stop_ids) or None,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            use_cache=True,
        )
        if not params.is_greedy:
            # Temperature and top-k/top-p live in the processor; HF's own warpers stay off.
            generation_config.update(temperature=1.0, top_k=0, top_p=1.0)
        recorder = _RoutingRecorder(self.model, len(rows))
        try:
            # HF generation makes thousands of small torch calls and needs no CUDA->CPU rewriting.
            output = without_device_rewriting(self.model.generate)(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=generation_config,
                logits_processor=transformers.LogitsProcessorList([processor]),
                stopping_criteria=transformers.StoppingCriteriaList([_PauseCriteria(self, epoch)]),
            )
        finally:
            routed = recorder.close()
        generated = output.sequences[:, width:]
        aborted = self._abort_epoch != epoch
        if generated.shape[1] == 0:
            return [RolloutSample([], [], "abort") for _ in rows]
        log_probs = processor.finish(generated[:, -1]).cpu()
        generated = generated.cpu()
        samples = []
        for i in range(len(rows)):
            tokens = generated[i].tolist()
            # The first stop token ends the row; HF pads the rest (pad may itself be a stop id).
            stop_at = next((j for j, t in enumerate(tokens) if t in stop_ids), None)
            if stop_at is not None:
                length, reason = stop_at + 1, "stop"
            elif len(tokens) == params.max_new_tokens and not aborted:
                length, reason = len(tokens), "length"
            else:
                length, reason = len(tokens), "abort"
            experts = None
            if routed is not None:  # the prompt and the response, its last token excepted
                experts = routed[i, width - len(rows[i]):width + length - 1].clone()
            samples.append(RolloutSample(tokens[:length], log_probs[i, :length].tolist(), reason, experts))
        return samples

    # ----------------------------------------------------------------------------- weights

    def begin_weight_update(self) -> None:
        if self._in_weight_update:
            raise WeightUpdateError("a weight-update session is already open; call end_weight_update() first")
        self._in_weight_update = True
        if self._adapter_config is not None:  # the merged weights being pushed hold the adapters
            self.model, self._adapter_config = self.model.unload(), None

    @torch.no_grad()
    def push_adapters(self, tensors: dict[str, torch.Tensor], peft_config: dict) -> None:
        """PEFT's LoRA layers of the model, filled with ``tensors``."""
        import peft

        if WEIGHTS in self._released:
            raise WeightUpdateError("push_adapters() while the weights are released; call resume_memory(['weights']) first")
        if self._adapter_config is None:
            raise WeightUpdateError("push_adapters(): this engine serves no LoRA adapters (started without `lora`, or a "
                                    "merged weight push replaced them)")
        if self._adapter_config != peft_config:
            raise WeightUpdateError(f"adapters of another config ({peft_config}) than the served ones ({self._adapter_config})")
        dtype = next(self.model.parameters()).dtype
        result = peft.set_peft_model_state_dict(self.model, {name: t.to(self.device, dtype) for name, t in tensors.items()})
        missing = [name for name in result.missing_keys if "lora_" in name]
        if missing or result.unexpected_keys:
            raise WeightUpdateError(f"the pushed adapters do not fit the model's LoRA layers: missing {missing[:3]}, "
                                    f"unexpected {list(result.unexpected_keys)[:3]}")

    @torch.no_grad()
    def push_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        if not self._in_weight_update:
            raise WeightUpdateError("push_weights() outside a session; call begin_weight_update() first")
        if WEIGHTS in self._released:
            raise WeightUpdateError("push_weights() while the weights are released; call resume_memory(['weights']) first")
        for name, tensor in named_tensors:
            target = self.served_weight(name)
            if target is None:
                raise WeightUpdateError(
                    f"weight {name!r} is not in the model (HF names expected, e.g. {next(iter(self._named_state))!r})"
                )
            if tuple(tensor.shape) != tuple(target.shape):
                raise WeightUpdateError(f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}")
            target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))

    def served_weight(self, name: str) -> torch.Tensor | None:
        """The model tensor under an HF checkpoint name (for an expert of a fused MoE block, its slice),
        which a pushed weight of that name fills; None for a name the model does not have."""
        memory_name, expert, part = transformers_in_memory_slot(name)
        tensor = self._named_state.get(memory_name)
        if tensor is None or expert is None:
            return tensor
        rows = tensor[expert]
        if part == "down":
            return rows
        half = rows.shape[0] // 2
        return rows[:half] if part == "gate" else rows[half:]

    def end_weight_update(self) -> None:
        if not self._in_weight_update:
            raise WeightUpdateError("end_weight_update() without begin_weight_update()")
        self._in_weight_update = False

    # ----------------------------------------------------------------------------- lifecycle

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Free the weights' storage for real (their values are dropped: a weight push follows
        ``resume_memory``, as with SGLang's memory saver) and the device's cached blocks.

        The KV cache lives only inside one ``generate`` call, so releasing it gives the allocator's
        cache back to the device (nothing to do on CPU); transformers' ``generate`` captures no CUDA
        graphs, so that tag frees nothing.
        """
        tags = check_memory_tags(tags)
        if WEIGHTS in tags and WEIGHTS not in self._released and self._adapter_config is not None:
            # Serving adapters: no push brings the base weights back, so they wait in host memory
            # (SGLang's --enable-weights-cpu-backup); on a CPU device they stay where they are.
            if self.device.type != "cpu":
                for name, param in self.model.named_parameters():
                    self._host_weights[name] = param.data.to("cpu")
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        elif WEIGHTS in tags and WEIGHTS not in self._released:
            # Parameters keep their identity (``_named_state`` and tied aliases point at them);
            # only their storage goes. Buffers (rotary frequencies) are tiny and stay.
            self._released_shapes = {name: param.shape for name, param in self.model.named_parameters()}
            for param in self.model.parameters():
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._released.update(tags)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            _return_freed_heap_to_the_os()

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Allocate the weights again (zero-filled, so the memory is really taken now, as a GPU
        allocation is); their values arrive with the next weight push."""
        tags = check_memory_tags(tags)
        if WEIGHTS in tags and WEIGHTS in self._released and self._host_weights:
            for name, param in self.model.named_parameters():
                param.data = self._host_weights.pop(name).to(param.device)
        elif WEIGHTS in tags and WEIGHTS in self._released and self._released_shapes:
            for name, param in self.model.named_parameters():
                param.data = torch.zeros(self._released_shapes[name], dtype=param.dtype, device=param.device)
            self._released_shapes = {}
        self._released.difference_update(tags)

    def resident_weight_bytes(self) -> int:
        """Bytes of weight storage this engine holds now (0 while the weights are released)."""
        return sum(param.untyped_storage().nbytes() for param in self.model.parameters())

    def pause_generation(self, mode: PauseMode = "abort") -> None:
        # "retract" and "in_place" both keep the KV cache here: in-flight rows wait and continue.
        check_pause_mode(mode)
        self._not_paused.clear()
        if mode == "abort":
            self._abort_epoch += 1

    def continue_generation(self) -> None:
        self._not_paused.set()

    def health(self) -> bool:
        return self.model is not None

    def shutdown(self) -> None:
        self._not_paused.set()
        self.model = None
        self._named_state = {}
