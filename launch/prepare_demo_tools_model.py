"""The CPU tool-use demo's model and data: the demo Llama, warmed up to call a calculator now and then.

    python -m launch.prepare_demo_tools_model [--out DIR] [--force]

writes, into DIR (default ``.cache/models/demo-tools``):

- an HF model folder (``LlamaForCausalLM`` + the character tokenizer), started from the weights of
  ``launch.prepare_demo_model``'s demo-arith model (built first if missing): it already knows the
  prompt format and the digits;
- ``data/train.parquet`` and ``data/val.parquet``: reasoning-gym ``basic_arithmetic`` products of two
  2-digit terms ("Calculate 47 * 83."; reasoning-gym draws each term from 0..100), ``last_number``
  answer extraction, written by ``launch.data.reasoning_gym`` and scored by ``engine.rewards``;
- ``demo_tools_recipe.json``: the recipe, its hash and what the warm-up reached, measured on the val
  prompts through the real multi-turn rollout (``generate_trajectories`` on a ``TorchRolloutEngine``
  with the tools of ``yaml/tools/demo_calculator.yaml``), greedy and sampled at temperature 1.

A ~1M-parameter model cannot multiply two 2-digit numbers; with the calculator it only has to copy
the factors into the call and the tool's result into its answer. The warm-up is a short SFT on a
thousand conversations (another seed; Parquet questions excluded): a fraction ``tool_fraction`` (a
quarter) call the tool ::

    user: Calculate 47 * 83.
    assistant: <tool_call>{"name":"calc","arguments":{"expr":"47*83"}}</tool_call>
    tool: 3901
    assistant: 3901

and the rest answer at once (their answers are right, but the model cannot learn multiplication from
750 of them). Loss is on the assistant turns only, and the tokens are exactly the rollout's: the
prompt, the call and ``<|im_end|>``, the tool message as ``MessageTokens`` appends it, the answer
(``assert_rollout_layout``). Copying is what takes the time (~1000 small steps, ~2 min on one
core); with 500 conversations (125 calls) greedy decoding called the tool on most prompts, and with
2000 tool steps it called it on 92% (right on 54%): little left for PPO to find.

Measured (recipe hash in the JSON; one CPU thread): greedy accuracy 0.06 (tool use 0.155, right on
0.35 of those), sampled tool use 0.185 with accuracy 0.16 when the tool is called and 0.0 without.
PPO has to find that calling the tool pays. A folder whose recipe hash matches is reused as is.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from engine.models.char_tokenizer import PAD_TOKEN_ID, build_char_tokenizer
from launch import prepare_demo_model as demo

logger = logging.getLogger(__name__)

REPO_ROOT = demo.REPO_ROOT
DEFAULT_DIR = REPO_ROOT / ".cache" / "models" / "demo-tools"
TOOL_CONFIG = REPO_ROOT / "yaml" / "tools" / "demo_calculator.yaml"
RECIPE_FILE = "demo_tools_recipe.json"  # written last: a folder without it is an interrupted run
DATA_SUBDIR = demo.DATA_SUBDIR
# Bump when the code changes what a recipe produces (the hash then no longer matches old folders).
RECIPE_VERSION = 1
TOOL_NAME = "calc"
# The prompt is at most "Calculate 100 * 100.<|im_start|>" (21 tokens). The longest tool-using response:
# the call (70 tokens with <|im_end|>), "10000<|im_start|>" (6), "10000<|im_end|>" (6) = 82 tokens.
MAX_PROMPT_LENGTH = 32
MAX_RESPONSE_LENGTH = 96  # prompt + response <= 128, the model's context


def _tools_data_config() -> demo.DemoDataConfig:
    return demo.DemoDataConfig(
        task_config={"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "operators": ["*"],
                     "allow_parentheses": False, "allow_negation": False},
        sft_pool_size=8000)


@dataclass(frozen=True)
class WarmupConfig:
    """The SFT warm-up: ``examples`` conversations, ``tool_fraction`` of them with a tool call.

    Two phases on the same conversations: ``tool_steps`` batches of the tool conversations only (the
    call format, and copying the factors into the call and the result into the answer: the slow part
    for a ~1M-parameter model), then ``mixed_steps`` batches of all of them, which bring the share of
    responses that start with a call down towards ``tool_fraction``.
    """

    examples: int = 1000
    tool_fraction: float = 0.25
    tool_steps: int = 1000
    mixed_steps: int = 150
    batch_size: int = 8
    mixed_batch_size: int = 32
    learning_rate: float = 2e-3
    mixed_learning_rate: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class ToolsEvalConfig:
    """How the warm-up is measured on the val prompts (the real multi-turn rollout)."""

    max_response_length: int = MAX_RESPONSE_LENGTH
    max_prompt_length: int = MAX_PROMPT_LENGTH
    sampled_repeats: int = 2  # temperature-1 trajectories per val prompt
    seed: int = 0


@dataclass(frozen=True)
class ToolsRecipe:
    """Everything that determines the demo-tools folder's contents; its hash keys the cache."""

    base: demo.DemoRecipe = field(default_factory=demo.DemoRecipe)  # the demo-arith model it starts from
    data: demo.DemoDataConfig = field(default_factory=_tools_data_config)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    eval: ToolsEvalConfig = field(default_factory=ToolsEvalConfig)

    def as_dict(self, tool_config: Path = TOOL_CONFIG) -> dict[str, Any]:
        return {"version": RECIPE_VERSION, "base_recipe_hash": self.base.hash(), "data": dataclasses.asdict(self.data),
                "warmup": dataclasses.asdict(self.warmup), "eval": dataclasses.asdict(self.eval),
                "tool_config_sha256": hashlib.sha256(Path(tool_config).read_bytes()).hexdigest()}

    def hash(self, tool_config: Path = TOOL_CONFIG) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(tool_config), sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class ToolsEvaluation:
    """Trajectories of the val prompts, scored by the reward functions (accuracy: score 1.0)."""

    accuracy: float
    tool_use: float  # fraction of trajectories with at least one tool call
    accuracy_with_tool: float | None  # among trajectories that called the tool (None: none did)
    accuracy_without_tool: float | None
    tool_errors: int
    truncated: float
    responses: list[str]  # the sampled tokens of each trajectory, decoded as the reward sees them
    trajectories: list[Any] = field(repr=False, default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {key: value for key, value in dataclasses.asdict(self).items()
                if key not in ("responses", "trajectories")}


@dataclass
class DemoToolsResult:
    """What ``prepare_demo_tools_model`` returns; ``measured`` is the recipe file's ``measured``."""

    model_dir: Path
    train_file: Path
    val_file: Path
    trained: bool  # False: a folder with the same recipe hash was reused
    measured: dict[str, Any]


# ----------------------------------------------------------------------------- conversations


def tool_call_text(expression: str) -> str:
    """The assistant's call, compact JSON (every character is a token)."""
    arguments = json.dumps({"name": TOOL_NAME, "arguments": {"expr": expression}}, separators=(",", ":"))
    return f"<tool_call>{arguments}</tool_call>"


def expression_of(question: str) -> str:
    """ "Calculate 47 * 83." -> "47*83" """
    prefix = "Calculate "
    if not question.startswith(prefix) or not question.endswith("."):
        raise ValueError(f"not a 'Calculate ...' question: {question!r}")
    return question[len(prefix):-1].replace(" ", "")


def tool_conversation(question: str, answer: str) -> list[dict]:
    """[user, assistant: the call, tool: its result (the answer), assistant: the answer]."""
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": tool_call_text(expression_of(question))},
            {"role": "tool", "name": TOOL_NAME, "content": answer},
            {"role": "assistant", "content": answer}]


def uses_tool(conversation: list[dict]) -> bool:
    return any(message["role"] == "tool" for message in conversation)


def direct_conversation(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def warmup_conversations(data: demo.DemoDataConfig, warmup: WarmupConfig,
                         exclude_questions: set[str]) -> list[list[dict]]:
    """``warmup.examples`` distinct questions of the SFT seed (minus ``exclude_questions``), a
    ``tool_fraction`` of them (chosen at random) as tool conversations, in a shuffled order."""
    pairs, seen = [], set()
    for question, answer in demo.sft_pairs(data, exclude_questions):
        if question not in seen:
            seen.add(question)
            pairs.append((question, answer))
    if len(pairs) < warmup.examples:
        raise ValueError(f"the SFT pool has {len(pairs)} distinct questions outside the Parquet files, fewer than "
                         f"warmup.examples={warmup.examples}; raise data.sft_pool_size")
    rng = random.Random(warmup.seed)
    pairs = rng.sample(pairs, warmup.examples)
    with_tool = round(warmup.tool_fraction * warmup.examples)
    conversations = [tool_conversation(*pair) for pair in pairs[:with_tool]]
    conversations += [direct_conversation(*pair) for pair in pairs[with_tool:]]
    rng.shuffle(conversations)
    return conversations


def rollout_layout(tokenizer: Any, message_tokens: Any, conversation: list[dict],
                   tools: list[dict] | None = None) -> list[int]:
    """The token ids a multi-turn rollout holds for ``conversation`` (a tool conversation or a direct
    one): the prompt as ``PromptDataset`` renders it, each assistant turn's text and ``<|im_end|>`` (what
    the engine samples), and the tool message as ``MessageTokens`` appends it after that ``<|im_end|>``."""
    from engine.data.dataset import render_chat_prompts
    from engine.data.schema import PromptRecord

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt = render_chat_prompts(tokenizer, [PromptRecord("", conversation[:1], "")], tools=tools)[0]
    ids = encode(prompt)
    pending: list[dict] = []
    for message in conversation[1:]:
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            ids += message_tokens.ids(pending, ids[-1])
            pending = []
        ids += encode(message["content"]) + [tokenizer.eos_token_id]
    return ids


def assert_rollout_layout(tokenizer: Any, message_tokens: Any, conversations: list[list[dict]],
                          examples: list[tuple[list[int], list[int]]]) -> None:
    """Each SFT example's ids are the rollout's ids of its conversation; its trained tokens are the
    assistant's (content and ``<|im_end|>``), nothing of the prompt or the tool message."""
    for conversation, (ids, labels) in zip(conversations, examples, strict=True):
        expected = rollout_layout(tokenizer, message_tokens, conversation)
        if ids != expected:
            raise AssertionError(f"the SFT tokens of {conversation} are {tokenizer.decode(ids)!r}, but a rollout "
                                 f"holds {tokenizer.decode(expected)!r}")
        trained = "".join(tokenizer.decode([token]) for token in labels if token != -100)
        wanted = "".join(m["content"] + tokenizer.eos_token for m in conversation if m["role"] == "assistant")
        if trained != wanted:
            raise AssertionError(f"the SFT trains {trained!r} of {conversation}, not the assistant's {wanted!r}")


# ----------------------------------------------------------------------------- training and evaluation


def _batch_loss(model: Any, batch: list[tuple[list[int], list[int]]]):
    """Mean loss over the batch's trained tokens; rows of similar length are padded together (a direct
    answer is ~25 tokens, a tool conversation ~90), so short rows cost no padding."""
    import torch

    groups: dict[bool, list] = {}
    for example in batch:
        groups.setdefault(len(example[0]) > 48, []).append(example)
    total, count = torch.zeros(()), 0
    for rows in groups.values():
        input_ids, attention_mask, labels = demo._collate(rows, PAD_TOKEN_ID)
        trained = int((labels[:, 1:] != -100).sum())  # HF shifts the labels by one
        total = total + model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss * trained
        count += trained
    return total / max(count, 1)


def train_warmup(model: Any, examples: list[tuple[list[int], list[int]]], tool_examples: list[int],
                 warmup: WarmupConfig, on_step: Any = None):
    """AdamW: ``warmup.tool_steps`` batches of the ``tool_examples`` (indices into ``examples``) at the
    learning rate (after a linear ramp), then ``warmup.mixed_steps`` batches of all ``examples`` from the
    mixed learning rate down to a tenth of it. ``on_step(step, model)`` (tuning) runs after every step."""
    import torch

    torch.manual_seed(warmup.seed)
    order = random.Random(warmup.seed)
    with_tool = [examples[index] for index in tool_examples]
    if warmup.tool_steps and not with_tool:
        raise ValueError("warmup.tool_steps > 0 but no warm-up conversation calls the tool")
    optimizer = torch.optim.AdamW(model.parameters(), lr=warmup.learning_rate, weight_decay=warmup.weight_decay)
    ramp = max(1, warmup.warmup_steps)
    model.train()
    started = time.monotonic()
    steps = warmup.tool_steps + warmup.mixed_steps
    for step in range(1, steps + 1):
        mixed = step > warmup.tool_steps
        pool, size = (examples, warmup.mixed_batch_size) if mixed else (with_tool, warmup.batch_size)
        for group in optimizer.param_groups:
            # The mixed phase decays linearly to a tenth: its last steps settle the share of tool calls.
            group["lr"] = (warmup.mixed_learning_rate * (1 - 0.9 * (step - warmup.tool_steps - 1) / warmup.mixed_steps)
                           if mixed else warmup.learning_rate * min(1.0, step / ramp))
        loss = _batch_loss(model, order.sample(pool, min(size, len(pool))))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), warmup.max_grad_norm)
        optimizer.step()
        if step % 100 == 0 or step == steps:
            logger.info("warm-up step %d (%s): loss %.4f, %.0f s", step, "mixed" if mixed else "tool calls",
                        loss.item(), time.monotonic() - started)
        if on_step is not None:
            on_step(step, model)
    return model.eval()


def evaluate_with_tools(model_dir: str | os.PathLike, val_file: str | os.PathLike, *, temperature: float,
                        repeats: int = 1, eval_config: ToolsEvalConfig = ToolsEvalConfig(),
                        tool_config: str | os.PathLike = TOOL_CONFIG) -> ToolsEvaluation:
    """Trajectories of the val prompts (``repeats`` each) through the rollout path the trainer runs, scored
    as the trainer scores them: the sampled tokens (loss mask 1) decoded, then ``engine.rewards``."""
    import torch
    from transformers import AutoTokenizer

    from engine.config.actor_rollout_ref import RolloutConfig
    from engine.data import PromptDataset
    from engine.rewards import RewardConfig, RewardManager
    from engine.rollout.agentic.messages import MessageTokens
    from engine.rollout.agentic.tools import load_tools, tool_schemas
    from engine.rollout.agentic.trajectory import Agent, TrajectoryTask, generate_trajectories
    from engine.rollout.base import SamplingParams
    from engine.rollout.torch_engine import TorchRolloutEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tools = load_tools(str(tool_config))
    dataset = PromptDataset(str(val_file), tokenizer, max_prompt_length=eval_config.max_prompt_length,
                            files_key="data.val_files", tools=tool_schemas(tools))
    samples = [sample for sample in dataset.samples for _ in range(repeats)]
    tasks = [TrajectoryTask(sample.prompt_ids, {"messages": sample.record.messages,
                                                "data_source": sample.record.data_source,
                                                "ground_truth": sample.record.ground_truth,
                                                "extra_info": sample.record.extra_info}) for sample in samples]
    engine = TorchRolloutEngine(str(model_dir), RolloutConfig(name="torch", dtype="float32"), device="cpu",
                                max_batch_size=512)
    agent = Agent(MessageTokens(tokenizer), tools)
    torch.manual_seed(eval_config.seed)
    trajectories = generate_trajectories(
        engine, tasks, SamplingParams(max_new_tokens=eval_config.max_response_length, temperature=temperature), agent)
    responses = [tokenizer.decode([token for token, mask in zip(t.token_ids, t.loss_mask) if mask],
                                  skip_special_tokens=True) for t in trajectories]
    manager = RewardManager(RewardConfig())
    records = [sample.record for sample in samples]
    manager.check_data_sources({record.data_source for record in records})
    scores = manager.score(responses, [r.data_source for r in records], [r.ground_truth for r in records],
                           [r.extra_info for r in records]).scores.tolist()
    right = [score == 1.0 for score in scores]
    used = [t.stats.tool_calls > 0 for t in trajectories]

    def mean(values: list[bool]) -> float | None:
        return sum(values) / len(values) if values else None

    return ToolsEvaluation(
        accuracy=mean(right), tool_use=mean(used),
        accuracy_with_tool=mean([r for r, u in zip(right, used) if u]),
        accuracy_without_tool=mean([r for r, u in zip(right, used) if not u]),
        tool_errors=sum(t.stats.tool_errors for t in trajectories),
        truncated=mean([t.stats.truncated for t in trajectories]), responses=responses, trajectories=trajectories)


# ----------------------------------------------------------------------------- the folder


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Torch on one thread for the block: as fast as two for this model on a busy 2-core machine, and
    the same weights and measured numbers whoever builds the folder (the CLI, or a test worker that
    runs with OMP_NUM_THREADS=1)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _result(model_dir: Path, recorded: dict[str, Any], trained: bool) -> DemoToolsResult:
    data_dir = model_dir / DATA_SUBDIR
    return DemoToolsResult(model_dir=model_dir, train_file=data_dir / "train.parquet",
                           val_file=data_dir / "val.parquet", trained=trained, measured=recorded["measured"])


def prepare_demo_tools_model(out_dir: str | os.PathLike = DEFAULT_DIR, recipe: ToolsRecipe | None = None, *,
                             base_dir: str | os.PathLike = demo.DEFAULT_DIR, force: bool = False) -> DemoToolsResult:
    """Build (or reuse, when its recipe hash matches) the demo-tools folder; see the module doc."""
    import torch
    from transformers import LlamaForCausalLM

    from engine.data.schema import read_prompt_file
    from engine.rollout.agentic.messages import MessageTokens

    recipe = recipe or ToolsRecipe()
    warmup = recipe.warmup
    if (warmup.examples <= 0 or min(warmup.batch_size, warmup.mixed_batch_size) <= 0
            or min(warmup.tool_steps, warmup.mixed_steps) < 0 or not 0 <= warmup.tool_fraction <= 1):
        raise ValueError(f"warmup.examples={warmup.examples}, batch_size={warmup.batch_size} and mixed_batch_size="
                         f"{warmup.mixed_batch_size} must be > 0, tool_steps={warmup.tool_steps} and mixed_steps="
                         f"{warmup.mixed_steps} >= 0, tool_fraction={warmup.tool_fraction} in [0, 1]")
    base = demo.prepare_demo_model(base_dir, recipe.base)
    out_dir = Path(out_dir).resolve()

    def build(staging: Path) -> dict[str, Any]:
        started = time.monotonic()
        train_file, val_file = demo.generate_demo_data(recipe.data, staging / DATA_SUBDIR)
        records = read_prompt_file(train_file) + read_prompt_file(val_file)
        tokenizer = build_char_tokenizer(model_max_length=recipe.base.model.max_position_embeddings)
        conversations = warmup_conversations(recipe.data, warmup, {record.messages[-1]["content"] for record in records})
        examples = demo.encode_sft_conversations(tokenizer, conversations)
        assert_rollout_layout(tokenizer, MessageTokens(tokenizer), conversations, examples)
        longest = max(len(ids) for ids, _ in examples)
        if longest > MAX_PROMPT_LENGTH + recipe.eval.max_response_length:
            raise ValueError(f"a warm-up conversation has {longest} tokens, more than the demo's prompt + "
                             f"response budget")
        model = LlamaForCausalLM.from_pretrained(base.model_dir, dtype=torch.float32)
        tool_examples = [index for index, conversation in enumerate(conversations) if uses_tool(conversation)]
        with single_thread():
            model = train_warmup(model, examples, tool_examples, warmup)
        demo.save_char_model(model, tokenizer, staging)
        trained_s = time.monotonic() - started
        with single_thread():
            greedy = evaluate_with_tools(staging, val_file, temperature=0.0, eval_config=recipe.eval)
            sampled = evaluate_with_tools(staging, val_file, temperature=1.0,
                                          repeats=recipe.eval.sampled_repeats, eval_config=recipe.eval)
        logger.info("demo-tools model in %s: greedy %s; sampled %s", out_dir, greedy.summary(), sampled.summary())
        return {"recipe": recipe.as_dict(), "base_model": str(base.model_dir),
                "warmup_conversations": len(conversations), "warmup_tool_conversations": len(tool_examples),
                "measured": {"greedy": greedy.summary(), "sampled": sampled.summary()},
                "train_seconds": round(trained_s, 1), "build_seconds": round(time.monotonic() - started, 1)}

    recorded, trained = demo.build_once(out_dir, RECIPE_FILE, recipe.hash(), force, build)
    return _result(out_dir, recorded, trained=trained)


def main(argv: list[str] | None = None) -> None:
    defaults = ToolsRecipe()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help="model folder (reused if its recipe matches)")
    parser.add_argument("--base", type=Path, default=demo.DEFAULT_DIR,
                        help="the demo-arith folder to start from (built if missing)")
    parser.add_argument("--examples", type=int, default=defaults.warmup.examples, help="warm-up conversations")
    parser.add_argument("--tool-fraction", type=float, default=defaults.warmup.tool_fraction,
                        help="fraction of the warm-up conversations that call the tool")
    parser.add_argument("--tool-steps", type=int, default=defaults.warmup.tool_steps,
                        help="warm-up steps on the tool conversations only")
    parser.add_argument("--mixed-steps", type=int, default=defaults.warmup.mixed_steps,
                        help="warm-up steps on all conversations, after those")
    parser.add_argument("--lr", type=float, default=defaults.warmup.learning_rate, help="warm-up learning rate")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder's recipe matches")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    recipe = dataclasses.replace(defaults, warmup=dataclasses.replace(
        defaults.warmup, examples=args.examples, tool_fraction=args.tool_fraction,
        tool_steps=args.tool_steps, mixed_steps=args.mixed_steps, learning_rate=args.lr))
    try:
        result = prepare_demo_tools_model(args.out, recipe, base_dir=args.base, force=args.force)
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")
    print(json.dumps({key: str(value) if isinstance(value, Path) else value
                      for key, value in dataclasses.asdict(result).items()}))


if __name__ == "__main__":
    main()
