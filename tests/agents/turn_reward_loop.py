"""A user agent loop loaded by dotted path in the tests: the calculator, rewarding every model turn with
0.5 (per-turn rewards are added to the trajectory's end reward)."""

from asyncflow.agents.calculator import CalculatorLoop

TURN_REWARD = 0.5


class TurnRewardCalculator(CalculatorLoop):
    """The calculator with a constant reward per model turn."""

    def turn_reward(self, trajectory) -> float:
        return TURN_REWARD


def make_turn_reward(tokenizer) -> TurnRewardCalculator:
    """Factory with the agent-loop signature."""
    return TurnRewardCalculator(tokenizer)
