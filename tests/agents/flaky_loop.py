"""A user agent loop loaded by dotted path in the tests: the calculator, but its tool raises whenever the
first operand is even (about half the samples), whatever the model did; and every model turn earns a
constant turn reward (per-turn rewards are added to the trajectory's end reward)."""

from asyncflow.agents.calculator import CalculatorLoop

TURN_REWARD = 0.5


class FlakyCalculator(CalculatorLoop):
    """Raises on even first operands (at the first tool call, so a failed trajectory has one model turn);
    rewards each model turn with ``TURN_REWARD``."""

    def observe(self, trajectory):
        a, _ = self.task.operands(trajectory.prompt_ids)
        if a % 2 == 0:
            raise ConnectionError(f"calculator service unavailable for {a}")
        return super().observe(trajectory)

    def turn_reward(self, trajectory) -> float:
        return TURN_REWARD


def make_flaky(tokenizer) -> FlakyCalculator:
    """Factory with the agent-loop signature."""
    return FlakyCalculator(tokenizer)
