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


class RaisingCalculator(CalculatorTool):
    async def execute(self, arguments: dict, state: dict) -> str:
        raise RuntimeError("the calculator is broken")


class SleepingCalculator(CalculatorTool):
    async def execute(self, arguments: dict, state: dict) -> str:
        await asyncio.sleep(3600)
        return "never"


class FloodingCalculator(CalculatorTool):
    async def execute(self, arguments: dict, state: dict) -> str:
        return "9" * 10_000_000
