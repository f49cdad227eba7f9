"""Multi-turn, tool-using rollouts."""
