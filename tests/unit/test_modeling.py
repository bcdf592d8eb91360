"""Word tokenizer, tiny Qwen2 model and policy loading."""

from __future__ import annotations

import pytest
import torch
import transformers
from pydantic import ValidationError

from treegrpo_ray.config import TinyModelConfig
from treegrpo_ray.errors import UserInputError
from treegrpo_ray.modeling import (
    build_tiny_model,
    build_word_tokenizer,
    load_policy,
    load_tokenizer,
)

WORDS = ["<search>", "</search>", "p17", "works_for", "c3", ".", "?"]


def test_tokenizer_round_trip_through_auto_tokenizer(tmp_path):
    build_word_tokenizer(WORDS + ["p17"], tmp_path)  # duplicates are dropped
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    # <pad>=0, <unk>=1, <eos>=2, then the words in order.
    assert (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert len(tokenizer) == 10
    text = "<search> p17 </search>  p17 works_for c3 . ?"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == [3, 5, 4, 5, 6, 7, 8, 9]
    # Words come back joined by single spaces (no clean-up glues "." or "?" to a word).
    assert tokenizer.decode(ids) == "<search> p17 </search> p17 works_for c3 . ?"
    assert tokenizer("zebra p17", add_special_tokens=False)["input_ids"] == [1, 5]
    # Splitting is on white space only: "<search>p17" is one (unknown) word.
    assert tokenizer("<search>p17", add_special_tokens=False)["input_ids"] == [1]


def test_tiny_model_shape_and_parameter_count():
    model = build_tiny_model(TinyModelConfig(), vocab_size=220, seed=0)
    assert isinstance(model, transformers.Qwen2ForCausalLM)
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # embed 220*128 = 28160; per layer: q 128*128+128, k and v 128*64+64 each, o 128*128,
    # MLP 3*128*512, 2 norms of 128 -> 246272; 2 layers + final norm 128 -> 520832.
    assert sum(p.numel() for p in model.parameters()) == 520832


def test_tiny_model_is_seeded():
    a = build_tiny_model(TinyModelConfig(), vocab_size=20, seed=3)
    b = build_tiny_model(TinyModelConfig(), vocab_size=20, seed=3)
    c = build_tiny_model(TinyModelConfig(), vocab_size=20, seed=4)
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_save_and_load_policy_gives_identical_logits(tmp_path):
    tokenizer = build_word_tokenizer(WORDS, tmp_path)
    model = build_tiny_model(TinyModelConfig(num_layers=1), len(tokenizer), seed=0).eval()
    model.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_policy(tmp_path)
    ids = torch.tensor([[3, 5, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    # Next to a qwen2 config.json the word-level pipeline survives (AutoTokenizer would swap in
    # Qwen2Tokenizer and glue the words together).
    assert loaded_tokenizer.decode([3, 5, 4]) == "<search> p17 </search>"
    assert load_tokenizer(tmp_path).get_vocab() == tokenizer.get_vocab()


def test_load_policy_errors_name_the_path_and_fix(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(UserInputError, match=f"policy directory {missing} does not exist"):
        load_policy(missing)
    build_word_tokenizer(WORDS, tmp_path)
    with pytest.raises(UserInputError, match="has no config.json; it must hold a model saved"):
        load_policy(tmp_path)
    # The model has 8 embedding rows, the tokenizer 10 tokens.
    build_tiny_model(TinyModelConfig(num_layers=1), vocab_size=8, seed=0).save_pretrained(tmp_path)
    with pytest.raises(UserInputError, match="tokenizer does not match the model") as err:
        load_policy(tmp_path)
    assert "10 tokens but only 8 embedding rows" in str(err.value)
    assert "\n" not in str(err.value)


def test_tiny_model_config_validation():
    with pytest.raises(ValidationError, match="num_heads must divide hidden_size"):
        TinyModelConfig(hidden_size=130)
    with pytest.raises(ValidationError, match="extra"):
        TinyModelConfig(layers=2)
