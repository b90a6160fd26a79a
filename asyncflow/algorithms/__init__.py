"""RL algorithms: advantage estimators (GAE included), policy and value losses, each in a small registry."""

from asyncflow.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from asyncflow.algorithms.gae import gae, outcome_token_rewards, whiten
from asyncflow.algorithms.losses import KL_ESTIMATORS, POLICY_LOSSES, VALUE_LOSSES, aggregate, kl_penalty

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "VALUE_LOSSES",
    "aggregate",
    "compute_advantages",
    "gae",
    "kl_penalty",
    "outcome_token_rewards",
    "whiten",
]
