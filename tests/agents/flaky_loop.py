"""A user agent loop loaded by dotted path in the tests: the calculator, but its tool raises whenever the
first operand is even (about half the samples), whatever the model did."""

from asyncflow.agents.calculator import CalculatorLoop


class FlakyCalculator(CalculatorLoop):
    """Raises on even first operands."""

    def observe(self, trajectory):
        a, _ = self.task.operands(trajectory.prompt_ids)
        if a % 2 == 0:
            raise ConnectionError(f"calculator service unavailable for {a}")
        return super().observe(trajectory)


def make_flaky(tokenizer) -> FlakyCalculator:
    """Factory with the agent-loop signature."""
    return FlakyCalculator(tokenizer)
