"""Environments and tools the multi-turn tests load by class path (as users' YAML files name theirs)."""
from __future__ import annotations

import asyncio

from engine.rollout.agentic.environment import Environment, EnvironmentStep
from engine.rollout.agentic.tools import CalculatorTool


class AskAgain(Environment):
    """A user who asks "Sure?" once after the model's answer (a reward of 0.25 for answering), then ends."""

    async def reset(self, row: dict) -> None:
        self.asked = False

    async def step(self, assistant_message: str) -> EnvironmentStep:
        if self.asked:
            return EnvironmentStep(reward=0.0, done=True)
        self.asked = True
        return EnvironmentStep([{"role": "user", "content": "Sure?"}], reward=0.25, done=False)


class ChaosCalculator(CalculatorTool):
    """The demo's calculator gone bad, one way per call, picked by the expression: it raises, sleeps an
    hour (past any time limit), or prints 10 MB."""

    MODES = ("raise", "sleep", "flood")

    @classmethod
    def mode(cls, expression: str) -> str:
        return cls.MODES[sum(map(ord, expression)) % len(cls.MODES)]

    async def execute(self, arguments: dict, state: dict) -> str:
        mode = self.mode(str(arguments.get("expr", "")))
        if mode == "raise":
            raise RuntimeError("the calculator is broken")
        if mode == "sleep":
            await asyncio.sleep(3600)
        return "9" * 10_000_000
