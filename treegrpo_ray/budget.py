"""Exact rollout cost accounting per prompt group (DESIGN §1, item 6).

Counters are incremented by the rollout worker as work happens, so they measure what was actually
generated (including branches that K-pruning later drops), not a nominal budget.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class Budget:
    """generated_tokens: sampled tokens; tool_calls: environment tool invocations; prefill_tokens:
    prefix tokens the engine had to compute; cached_tokens: prefix tokens served from a KV cache;
    leaves: finished trajectories produced."""

    generated_tokens: int = 0
    tool_calls: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    leaves: int = 0

    def count_step(
        self, generated: int, prefill: int, cached: int, tool_call: bool, leaf: bool
    ) -> None:
        """Record one generated action: its tokens, its prefix work, its tool call and leaf."""
        self.generated_tokens += generated
        self.prefill_tokens += prefill
        self.cached_tokens += cached
        self.tool_calls += int(tool_call)
        self.leaves += int(leaf)

    def add(self, other: Budget) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_dict(self) -> dict[str, int]:
        return asdict(self)
