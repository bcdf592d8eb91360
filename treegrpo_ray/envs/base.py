"""The AgentEnv protocol: what a rollout worker needs from an environment.

An environment is stateless: every method takes a state and returns a new one, so branching a tree
means calling ``step`` again on an ancestor's state. States must be immutable (frozen dataclasses).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Sample:
    """One task instance (a prompt group's question).

    ``uid`` is unique within a data split; ``answers`` are the gold answers used by the reward.
    """

    uid: str
    question: str
    answers: tuple[str, ...]
    meta: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class StepResult:
    """What ``AgentEnv.step`` returns for one action.

    observation: text appended after the action (empty string when the episode ended).
    state: the new state (the input state is never mutated).
    done: the episode ended (an answer was given or the turn limit was reached).
    role: the kind of step the action was (e.g. ``search``, ``answer``, ``invalid``).
    tool_call: whether the action called a tool (counted in the budget).
    """

    observation: str
    state: Any
    done: bool
    role: str
    tool_call: bool


@dataclass(frozen=True)
class EpisodeState:
    """One episode's position (the state of the QA environments): the sample, actions taken, the
    answer given, whether every action so far was well formed, whether the episode ended."""

    sample: Sample
    turn: int = 0
    answer: str | None = None
    format_valid: bool = True
    done: bool = False


class AgentEnv(Protocol):
    """A multi-turn agent environment driven by text actions."""

    stop_sequences: tuple[str, ...]
    """Strings that end an action (e.g. ``</search>``); generation stops after any of them."""

    def reset(self, sample: Sample) -> tuple[str, Any]:
        """Return ``(prompt_text, initial_state)`` for a sample."""
        ...

    def step(self, state: Any, action_text: str) -> StepResult:
        """Apply one action to ``state`` and return the observation and the new state."""
        ...

    def step_batch(self, states: Sequence[Any], action_texts: Sequence[str]) -> list[StepResult]:
        """``step`` over many branches at once, so a tool can serve them in one call."""
        ...

    def reward(self, state: Any) -> float:
        """Reward of a finished (or truncated) episode."""
        ...

    def success(self, state: Any) -> bool:
        """Whether the episode's final answer is correct (exact match), whatever its format."""
        ...


class Task(Protocol):
    """A task's questions: the split the run trains on and the held-out split it is evaluated
    on, each in a fixed order (``MultihopTask``, ``SearchQATask``)."""

    def train_samples(self) -> list[Sample]: ...

    def heldout_samples(self) -> list[Sample]: ...
