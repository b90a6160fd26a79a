"""The add-one reward, 5 ms a row: the reward and advantage tasks lag behind rollout, so the sample stream claims a
step's groups before dynamic sampling judges them (``tests/workflow/test_stream.py``'s DAPO run)."""

import time

from asyncflow.rewards.registry import make_add1_reward

ROW_S = 0.005


def make_slow_add1(tokenizer):
    """``add1``, slowed by ``ROW_S`` a row."""
    reward = make_add1_reward(tokenizer)

    def slow(prompt_ids, response_ids):
        time.sleep(ROW_S)
        return reward(prompt_ids, response_ids)

    return slow
