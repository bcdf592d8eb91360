"""Stop strings matched on the decoded text of generated tokens.

An action ends at a string such as ``</search>``, but a subword tokenizer need not produce the
string's own tokens: a byte-level BPE may merge its ``>`` with what follows (``>\\n\\n`` is one
token in Qwen2.5's vocabulary), so a match on the token ids of ``encode("</search>")`` misses
it and the action runs on to its token limit. So the stop is the first token after which the
decoded text contains the string; that token (whole, whatever it adds after the string) is the
last token of the action.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True, eq=False)
class StopStrings:
    """``strings`` that end generation; ``decode`` turns token ids into text (the tokenizer's).

    Every token of a match adds at least one of its characters, so the text of the last
    ``window`` tokens holds any match that the last token completes.
    """

    strings: tuple[str, ...]
    decode: Decode

    def __post_init__(self) -> None:
        if not self.strings or not all(self.strings):
            raise ValueError(f"stop strings must be non-empty, got {self.strings!r}")

    @cached_property  # read after every generated token
    def window(self) -> int:
        return max(len(s) for s in self.strings) + 1

    def completed(self, token_ids: Sequence[int]) -> bool:
        """Whether the text of the last ``window`` tokens contains a stop string: checked after
        every new token, the first True is at the token that completes the first match."""
        return self._found(token_ids[-self.window :])

    def end(self, token_ids: Sequence[int]) -> int | None:
        """Length of the shortest prefix of ``token_ids`` whose text contains a stop string, or
        None (a binary search: a prefix that contains one stays containing it)."""
        if not self._found(token_ids):
            return None
        low, high = 1, len(token_ids)
        while low < high:
            mid = (low + high) // 2
            if self._found(token_ids[:mid]):
                high = mid
            else:
                low = mid + 1
        return low

    def _found(self, token_ids: Sequence[int]) -> bool:
        text = self.decode(token_ids)
        return any(s in text for s in self.strings)
