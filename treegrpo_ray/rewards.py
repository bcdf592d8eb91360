"""Answer rewards: exact match, token F1 and the paper's format-aware exact match.

Normalisation follows the SQuAD / Search-R1 convention: lower-case, drop punctuation, drop the
articles a/an/the, collapse white space.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)

FORMAT_REWARDS = {
    (True, True): 1.0,  # correct answer, valid format
    (True, False): 0.8,  # correct answer, invalid format somewhere in the trajectory
    (False, True): 0.2,  # wrong answer, valid format
    (False, False): 0.1,  # wrong answer, invalid format
}


def normalize_answer(text: str) -> str:
    """Lower-case, strip punctuation and articles, collapse white space."""
    text = text.lower().translate(_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(gold) for gold in golds))


def format_aware_em(prediction: str | None, golds: Sequence[str], format_valid: bool) -> float:
    """The paper's format-aware score: 1.0 / 0.8 / 0.2 / 0.1 by (correct, valid), 0.0 if no answer."""
    if prediction is None:
        return 0.0
    return FORMAT_REWARDS[(exact_match(prediction, golds) == 1.0, format_valid)]
