"""Stop strings on decoded text: hand-made token texts, and a byte-level BPE tokenizer trained
here with Qwen2's pre-tokenizer pattern, where ``</search>`` followed by a newline is not the
token sequence of ``encode("</search>")``."""

import pytest
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from treegrpo_ray.stops import StopStrings

TEXT = {1: "a ", 2: "</", 3: "search", 4: ">", 5: ">\n\n", 6: "</answer>", 7: "b "}


def decode(ids):
    return "".join(TEXT[i] for i in ids)


STOPS = StopStrings(("</search>", "</answer>"), decode)


def test_end_is_the_token_that_completes_the_first_match():
    assert STOPS.end([1, 2, 3, 4, 1]) == 4
    assert STOPS.end([1, 2, 3, 5, 1]) == 4  # ">\n\n" completes it and is kept whole
    assert STOPS.end([1, 6, 2, 3, 4]) == 2  # the earlier of the two strings
    assert STOPS.end([1, 2, 3, 1, 4]) is None  # "</searcha >": no match
    assert STOPS.end([]) is None


def test_checked_after_every_token_it_fires_where_end_says():
    for ids in ([1, 2, 3, 5, 1], [7, 7, 6], [1, 2, 3, 1, 4]):
        fired = next((n for n in range(1, len(ids) + 1) if STOPS.completed(ids[:n])), None)
        assert fired == STOPS.end(ids)


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(("</search>", ""), decode)
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings((), decode)


# Qwen2's pre-tokenizer regex (tokenizer.json of Qwen2.5): punctuation takes trailing newlines.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LINES = [
    "<think> i need to find who wrote book {i} </think>\n<search> author of book {i} </search>\n\n"
    "<information> Doc 1 (Title: book {i}) written by author {i} </information>\n\n"
    "<answer> author {i} </answer>"
]


@pytest.fixture(scope="module")
def bpe_tokenizer():
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    core.train_from_iterator([line.format(i=i) for line in LINES for i in range(200)], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core)


def _contains(seq, part):
    return any(seq[i : i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_a_stop_string_merged_into_a_bpe_token_is_found(bpe_tokenizer):
    tok = bpe_tokenizer
    generated = tok.encode("<search> author of book 7 </search>\n\n<information>")
    stop_ids = tok.encode("</search>")
    # the premise: the tokens of "</search>" alone are not in what a model would generate
    assert not _contains(generated, stop_ids)  # " </" and ">\n\n" are tokens of their own

    stops = StopStrings(("</search>", "</answer>"), tok.decode)
    end = stops.end(generated)
    assert end is not None
    assert tok.convert_ids_to_tokens(generated)[end - 1] == ">ĊĊ"  # byte-level for ">\n\n"
    assert tok.decode(generated[:end]) == "<search> author of book 7 </search>\n\n"
    assert not stops.completed(generated[: end - 1])
