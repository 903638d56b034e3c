"""Advantage estimators built on returns-to-go (docs/algorithms.md §2.1, 2.5, 2.6, 2.7).

Token rewards ``[B, T]`` carry the outcome on the last valid token (plus −β·kl per token
when the KL sits in the reward). A masked position (padding, or a tool/environment token
inside a multi-turn response) is *skipped*: its reward and value are ignored and the
recursion links each valid token to the next valid one, so earlier turns still see the
final reward (verl 0.9.1 behaviour; the 0.8 snapshot reset at masked tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from posttrain.algos.masked import masked_whiten
from posttrain.algos.registry import register_advantage, register_baseline


def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = r_t + γ·G_{next(t)} over valid tokens, next(t) the next valid position; 0 elsewhere.

    Shapes ``[B, T] -> [B, T]``. With γ = 1 this is Σ_{k ≥ t, m_k = 1} r_k.
    """
    valid = response_mask.bool()
    rewards = torch.where(valid, token_rewards, torch.zeros_like(token_rewards))
    if gamma == 1.0:
        # reverse cumulative sum: masked slots add 0, so skipping them is automatic
        to_go = rewards.flip(-1).cumsum(-1).flip(-1)
        return torch.where(valid, to_go, torch.zeros_like(to_go))
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[-1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, torch.zeros_like(running))
    return returns


@register_advantage("gae", values=True)
def gae(
    token_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor | None = None,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation with a value model, skipping masked positions.

        δ_t = r_t + γ·V_{next(t)} − V_t        (V after the last valid token = 0)
        A_t = δ_t + γλ·A_{next(t)}
        R_t = A_t + V_t                        (value targets, from the un-whitened A)
        A   ← whiten_m(A)                      (token-weighted over the batch; ``whiten``)

    Defaults are classic RLHF (γ = 1, λ = 0.95); verl uses λ = 1, the PPO paper γ = 0.99.
    Shapes: ``token_rewards, values, response_mask [B, T]``; returns ``(A, R)`` ``[B, T]``.
    Source: Schulman et al., "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation", 2016, eq. 16.
    """
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values from a critic; enable the value model")
    valid = response_mask.bool()
    zero = token_rewards.new_zeros(token_rewards.shape[0])
    next_value, next_adv = zero, zero
    advantages = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[-1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        here = valid[:, t]
        advantages[:, t] = torch.where(here, adv_t, zero)
        next_value = torch.where(here, values[:, t], next_value)
        next_adv = torch.where(here, adv_t, next_adv)
    returns = torch.where(valid, advantages + values, torch.zeros_like(advantages))
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@register_advantage("reinforce", baselines=("greedy", "running_mean"))
def reinforce(
    token_rewards: Tensor,
    response_mask: Tensor,
    baseline_scores: Tensor | None = None,
    *,
    gamma: float = 1.0,
    standardize: Literal["none", "sequence", "batch"] = "none",
    eps: float = 1.1920929e-07,
) -> tuple[Tensor, Tensor]:
    """REINFORCE with discounted returns and an optional baseline.

        G_t = r_t + γ·G_{next(t)};   A_t = G_t − b_i

    ``baseline_scores [B]`` is any per-response baseline b the caller keeps — a running
    mean of past rewards (:class:`RunningMeanBaseline`, seed 001) or a learned value. With an
    outcome reward and γ = 1 the loss becomes −(r − b)·Σ_t log π (``pg`` + ``seq-mean-token-sum``).
    ``standardize="sequence"`` rescales each episode's returns to zero mean, unit std
    (pytorch/examples CartPole, eps = float32 epsilon); ``"batch"`` whitens over all valid tokens.
    Returns are the raw G. Source: Williams, "Simple Statistical Gradient-Following
    Algorithms for Connectionist Reinforcement Learning", 1992.
    """
    returns = discounted_returns(token_rewards, response_mask, gamma)
    adv = returns
    if baseline_scores is not None:
        adv = torch.where(response_mask.bool(), returns - baseline_scores.unsqueeze(-1), torch.zeros_like(returns))
    if standardize == "sequence":
        adv = _standardize_rows(adv, response_mask, eps)
    elif standardize == "batch":
        adv = masked_whiten(adv, response_mask)
    elif standardize != "none":
        raise ValueError(f"unknown standardize mode {standardize!r}; valid: none, sequence, batch")
    return adv, returns


def _standardize_rows(x: Tensor, mask: Tensor, eps: float) -> Tensor:
    m = mask.to(x.dtype)
    count = m.sum(-1, keepdim=True)
    mean = (x * m).sum(-1, keepdim=True) / count.clamp(min=1)
    var = (((x - mean) * m) ** 2).sum(-1, keepdim=True) / (count - 1).clamp(min=1)
    return (x - mean) / (var.sqrt() + eps) * m


@register_advantage("reinforce_pp")
def reinforce_pp(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    gamma: float = 1.0,
    unbiased: bool = True,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted reward-to-go of the KL-shaped token rewards, whitened over the batch.

        r_t = 1[t = last]·r_i − β·kl_t       (shaped beforehand, see ``kl.shape_token_rewards``)
        G_t = r_t + γ·G_{next(t)};   A = whiten_m(G)

    Whitening is token-weighted over the global batch; ``unbiased=False`` is OpenRLHF's
    variance. Returns are the un-whitened G. Source: Hu, "REINFORCE++: A Simple and
    Efficient Approach for Aligning Large Language Models", 2025, §3.
    """
    returns = discounted_returns(token_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask, unbiased=unbiased), returns


@register_advantage("remax", baselines=("greedy",), baseline_required=True)
def remax(
    token_rewards: Tensor,
    response_mask: Tensor,
    baseline_scores: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """ReMax: reward-to-go minus the reward of the greedy response to the same prompt.

        G_t = Σ_{k ≥ t, m_k = 1} r_k;   A_t = G_t − r(x, ŷ_greedy)

    ``baseline_scores [B]`` holds r(x, ŷ_greedy) for each sample's prompt (one extra greedy
    decode per prompt); NaN (no reward for the greedy decode) raises: those samples have no
    baseline and must be masked out first. Returns are G. Source: Li et al., "ReMax: A Simple, Effective, and
    Efficient Reinforcement Learning Method for Aligning Large Language Models", 2023, Alg. 1.
    """
    if baseline_scores is None:
        raise ValueError("advantage estimator 'remax' needs baseline_scores (rewards of greedy decodes)")
    if bool(baseline_scores.isnan().any()):
        sample = int(torch.nonzero(baseline_scores.isnan())[0])
        raise ValueError(
            f"remax: baseline_scores is missing (NaN) for sample {sample}; a prompt whose greedy decode has no "
            "reward must be masked out before the advantage, not compared with a baseline of 0"
        )
    returns = discounted_returns(token_rewards, response_mask, 1.0)
    adv = torch.where(response_mask.bool(), returns - baseline_scores.unsqueeze(-1), torch.zeros_like(returns))
    return adv, returns


def reinforce_returns(
    rewards: Tensor, gamma: float = 0.99, *, standardize: bool = True, eps: float = 1.1920929e-07
) -> Tensor:
    """Classic episodic REINFORCE returns for one episode ``[T] -> [T]`` (seed 001, CartPole).

        G_t = r_t + γ·G_{t+1};   G ← (G − mean(G)) / (std(G) + eps)    (unbiased std)

    The standardisation is a per-episode constant baseline plus a scale; the loss is then
    Σ_t −log π(a_t|s_t)·G_t (``pg`` with ``token-sum``). Source: Williams, 1992; the
    recipe of pytorch/examples ``reinforcement_learning/reinforce.py``.
    """
    ones = torch.ones_like(rewards).unsqueeze(0)
    returns = discounted_returns(rewards.unsqueeze(0), ones, gamma).squeeze(0)
    if standardize and returns.numel() > 1:
        returns = (returns - returns.mean()) / (returns.std(unbiased=True) + eps)
    return returns


@dataclass
class RunningMeanBaseline:
    """b ← decay·b + (1 − decay)·mean(batch rewards), a baseline from past rewards (seed 001).

    Use :attr:`value` for the current batch *before* calling :meth:`update` with it, so a
    sample never serves as its own baseline. The first update sets b to the batch mean.
    """

    decay: float = 0.9
    value: float = 0.0
    initialised: bool = False

    def update(self, rewards: Tensor) -> float:
        batch_mean = float(rewards.float().mean())
        if self.initialised:
            self.value = self.decay * self.value + (1 - self.decay) * batch_mean
        else:
            self.value, self.initialised = batch_mean, True
        return self.value

    def state_dict(self) -> dict[str, float | bool]:
        return {"decay": self.decay, "value": self.value, "initialised": self.initialised}

    def load_state_dict(self, state: dict[str, float | bool]) -> None:
        self.decay, self.value, self.initialised = (
            float(state["decay"]),
            float(state["value"]),
            bool(state["initialised"]),
        )


register_baseline("running_mean")(RunningMeanBaseline)


@register_baseline("none")
def no_baseline() -> None:
    """No baseline: the estimator compares with nothing (or with its group)."""
    return None


@register_baseline("greedy", plays_greedy=True)
def greedy_baseline() -> None:
    """ReMax (Li et al., 2023): b = the reward of one greedy sample of the prompt, played and
    scored by the rollout source (``sources/greedy_baseline.py``); the loop keeps nothing."""
    return None
