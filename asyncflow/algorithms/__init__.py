"""RL algorithms: advantage estimators and policy losses, each in a small registry."""

from asyncflow.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from asyncflow.algorithms.losses import KL_ESTIMATORS, POLICY_LOSSES, aggregate, kl_penalty

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "aggregate",
    "compute_advantages",
    "kl_penalty",
]
