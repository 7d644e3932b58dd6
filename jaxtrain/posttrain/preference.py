"""Pairwise preference losses, per pair (the tasks sum them): inputs are per-sequence scores or
summed completion log-probabilities of the chosen (c) and rejected (r) answers, each [B]."""

import jax
import jax.numpy as jnp


def _logistic(logits_B, label_smoothing: float):
  """-log sigmoid(logits), with a share `label_smoothing` of the labels assumed flipped (cDPO)."""
  return (-(1 - label_smoothing) * jax.nn.log_sigmoid(logits_B)
          - label_smoothing * jax.nn.log_sigmoid(-logits_B))


def bradley_terry(chosen_B, rejected_B, label_smoothing: float = 0.0):
  """Reward models (Bradley & Terry, 1952; Ouyang et al., 2022): -log sigmoid(r_c - r_r)."""
  return _logistic(chosen_B - rejected_B, label_smoothing)


def dpo(policy_c_B, policy_r_B, ref_c_B, ref_r_B, beta: float, label_smoothing: float = 0.0):
  """DPO (Rafailov et al., 2023): -log sigmoid(beta [(pi_c - ref_c) - (pi_r - ref_r)])."""
  return _logistic(beta * ((policy_c_B - ref_c_B) - (policy_r_B - ref_r_B)), label_smoothing)


def ipo(policy_c_B, policy_r_B, ref_c_B, ref_r_B, beta: float):
  """IPO (Azar et al., 2023): ([(pi_c - ref_c) - (pi_r - ref_r)] - 1 / (2 beta))^2,
  on summed log-probs."""
  return jnp.square((policy_c_B - ref_c_B) - (policy_r_B - ref_r_B) - 1.0 / (2.0 * beta))


def simpo(policy_c_B, policy_r_B, length_c_B, length_r_B, beta: float, gamma: float,
          label_smoothing: float = 0.0):
  """SimPO (Meng et al., 2024), reference-free: -log sigmoid(beta (pi_c / |c| - pi_r / |r|) -
  gamma), the rewards being length-normalized log-probs."""
  return _logistic(beta * (policy_c_B / length_c_B - policy_r_B / length_r_B) - gamma,
                   label_smoothing)
