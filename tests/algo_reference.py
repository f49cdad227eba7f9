"""Independent float64 references for engine.algo, written from the papers' definitions with
explicit Python loops over sequences and tokens (no vectorised tensor code), plus batch builders
with ragged masks shared by the tests of engine/algo."""
from __future__ import annotations

import math
import statistics

import torch


def ragged_batch(
    batch_size: int, response_len: int, seed: int, holes: bool = True, dtype: torch.dtype = torch.float64
) -> dict[str, torch.Tensor]:
    """Random per-token tensors with right padding of random length and (optionally) masked holes
    inside responses. Every sequence keeps at least one response token."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, response_len + 1, (batch_size,), generator=generator)
    mask = (torch.arange(response_len).unsqueeze(0) < lengths.unsqueeze(1)).to(dtype)
    if holes:
        hole = torch.rand(batch_size, response_len, generator=generator) < 0.2
        hole[:, 0] = False
        mask = mask * (~hole).to(dtype)

    def randn() -> torch.Tensor:
        return torch.randn(batch_size, response_len, generator=generator, dtype=dtype)

    old_log_probs = -torch.rand(batch_size, response_len, generator=generator, dtype=dtype) * 3
    return {
        "response_mask": mask,
        "token_level_rewards": randn(),
        "values": randn(),
        "old_values": randn(),
        "returns": randn(),
        "advantages": randn(),
        "old_log_probs": old_log_probs,
        "log_probs": old_log_probs + 0.3 * randn(),
        "ref_log_probs": old_log_probs + 0.3 * randn(),
        "entropy": torch.rand(batch_size, response_len, generator=generator, dtype=dtype) * 2,
    }


def valid_positions(mask: torch.Tensor, row: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if mask[row, t] > 0]


def _to_matrix(rows: list[dict[int, float]], shape: torch.Size) -> torch.Tensor:
    out = torch.zeros(shape, dtype=torch.float64)
    for i, row in enumerate(rows):
        for t, value in row.items():
            out[i, t] = value
    return out


def _whiten_list(values: list[float]) -> list[float]:
    mean = statistics.fmean(values)
    variance = statistics.variance(values)  # unbiased, n - 1
    return [(v - mean) / math.sqrt(variance + 1e-8) for v in values]


def _whiten_rows(rows: list[dict[int, float]]) -> list[dict[int, float]]:
    flat = [(i, t, v) for i, row in enumerate(rows) for t, v in row.items()]
    whitened = _whiten_list([v for _, _, v in flat])
    out: list[dict[int, float]] = [{} for _ in rows]
    for (i, t, _), w in zip(flat, whitened):
        out[i][t] = w
    return out


def reference_gae(rewards, values, mask, gamma, lam):
    """A_k = sum_l (gamma lam)^l delta_{k+l} over the valid steps (the sum form, not the recursion)."""
    adv_rows, ret_rows = [], []
    for i in range(rewards.shape[0]):
        steps = valid_positions(mask, i)
        r = [float(rewards[i, t]) for t in steps]
        v = [float(values[i, t]) for t in steps]
        n = len(steps)
        deltas = [r[k] + gamma * (v[k + 1] if k + 1 < n else 0.0) - v[k] for k in range(n)]
        advantages = [sum((gamma * lam) ** l * deltas[k + l] for l in range(n - k)) for k in range(n)]
        adv_rows.append({t: a for t, a in zip(steps, advantages)})
        ret_rows.append({t: a + vk for t, a, vk in zip(steps, advantages, v)})
    return _to_matrix(adv_rows, rewards.shape), _to_matrix(ret_rows, rewards.shape)


def reference_whiten(matrix, mask):
    rows = [{t: float(matrix[i, t]) for t in valid_positions(mask, i)} for i in range(matrix.shape[0])]
    return _to_matrix(_whiten_rows(rows), matrix.shape)


def reference_reward_to_go_rows(rewards, mask, gamma):
    rows = []
    for i in range(rewards.shape[0]):
        steps = valid_positions(mask, i)
        r = [float(rewards[i, t]) for t in steps]
        rows.append({t: sum(gamma ** (l - k) * r[l] for l in range(k, len(r))) for k, t in enumerate(steps)})
    return rows


def _scores(rewards, mask):
    return [sum(float(rewards[i, t]) for t in valid_positions(mask, i)) for i in range(rewards.shape[0])]


def _groups(group_index):
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_index.tolist()):
        groups.setdefault(g, []).append(i)
    return groups


def _broadcast_rows(per_sequence, mask):
    return [{t: per_sequence[i] for t in valid_positions(mask, i)} for i in range(mask.shape[0])]


def reference_grpo(rewards, mask, group_index, norm_by_std, epsilon):
    scores = _scores(rewards, mask)
    advantage = [0.0] * len(scores)
    for members in _groups(group_index).values():
        if len(members) == 1:
            continue
        group_scores = [scores[i] for i in members]
        mean = statistics.fmean(group_scores)
        std = statistics.stdev(group_scores)
        for i in members:
            advantage[i] = (scores[i] - mean) / (std + epsilon) if norm_by_std else scores[i] - mean
    return _to_matrix(_broadcast_rows(advantage, mask), rewards.shape)


def reference_rloo(rewards, mask, group_index):
    scores = _scores(rewards, mask)
    advantage = [0.0] * len(scores)
    for members in _groups(group_index).values():
        for i in members:
            others = [scores[j] for j in members if j != i]
            if others:
                advantage[i] = scores[i] - sum(others) / len(others)
    return _to_matrix(_broadcast_rows(advantage, mask), rewards.shape)


def reference_reinforce_plus_plus(rewards, mask, gamma):
    rows = reference_reward_to_go_rows(rewards, mask, gamma)
    return _to_matrix(_whiten_rows(rows), rewards.shape), _to_matrix(rows, rewards.shape)


def reference_reinforce_plus_plus_baseline(rewards, mask, group_index):
    scores = _scores(rewards, mask)
    centred = [0.0] * len(scores)
    for members in _groups(group_index).values():
        mean = statistics.fmean(scores[i] for i in members)
        for i in members:
            centred[i] = scores[i] - mean
    return _to_matrix(_whiten_rows(_broadcast_rows(centred, mask)), rewards.shape)


def reference_remax(rewards, mask, baseline, gamma):
    rows = reference_reward_to_go_rows(rewards, mask, gamma)
    adv = [{t: g - float(baseline[i]) for t, g in row.items()} for i, row in enumerate(rows)]
    return _to_matrix(adv, rewards.shape), _to_matrix(rows, rewards.shape)


def reference_kl(log_prob: float, ref_log_prob: float, name: str) -> float:
    """Schulman's estimators with r = pi_ref / pi: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r."""
    log_r = ref_log_prob - log_prob
    base = name.rstrip("+")
    if base in ("kl", "k1"):
        return -log_r
    if base == "abs":
        return abs(log_r)
    if base in ("mse", "k2"):
        return 0.5 * log_r * log_r
    if base in ("low_var_kl", "k3"):
        log_r = min(max(log_r, -20.0), 20.0)
        return min(max(math.exp(log_r) - 1.0 - log_r, -10.0), 10.0)
    raise KeyError(name)


def reference_aggregate(per_token: list[dict[int, float]], mode: str, num_tokens, num_sequences, max_len=None) -> float:
    """Loss of the whole batch written out per mode; per_token rows hold the valid tokens only."""
    if mode == "token-mean":
        return sum(sum(row.values()) for row in per_token) / num_tokens
    if mode == "seq-mean-token-sum":
        return sum(sum(row.values()) for row in per_token) / num_sequences
    if mode == "seq-mean-token-mean":
        return sum(sum(row.values()) / len(row) for row in per_token if row) / num_sequences
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(row.values()) / max_len for row in per_token) / num_sequences
    raise KeyError(mode)


def reference_ppo_token(ratio: float, advantage: float, eps_low: float, eps_high: float, clip_c):
    """Per-token PPO loss and its clip flags from the objective form:
    J = min(rho A, clip(rho) A), dual-clip J = max(J, c A) for A < 0; loss = -J."""
    clipped_ratio = min(max(ratio, 1 - eps_low), 1 + eps_high)
    objective = min(ratio * advantage, clipped_ratio * advantage)
    if clip_c is not None and advantage < 0:
        objective = max(objective, clip_c * advantage)
    clipped = (advantage > 0 and ratio > 1 + eps_high) or (advantage < 0 and ratio < 1 - eps_low)
    lower = clip_c is not None and advantage < 0 and ratio > clip_c
    return -objective, clipped, lower
