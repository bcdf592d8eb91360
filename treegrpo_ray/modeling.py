"""Tiny policies for the CPU presets: a word-level tokenizer and a small Qwen2 model.

The tokenizer maps each white-space separated word to one id, so token boundaries equal word
boundaries and ``decode`` joins words with single spaces. The model is a standard
``Qwen2ForCausalLM`` built from a config, so every engine and learner that handles a real Qwen2.5
checkpoint handles it too.

Load a policy directory's tokenizer with :func:`load_tokenizer` (or :func:`load_policy`), not
``AutoTokenizer``: transformers 5 forces ``Qwen2Tokenizer`` on any directory whose config.json says
``qwen2``, and that class rebuilds a byte-level BPE pipeline that drops our word-level one (decode
then glues words together). ``AutoTokenizer`` is fine on a directory holding only the tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from treegrpo_ray.config import ModelConfig, TinyModelConfig
from treegrpo_ray.errors import UserInputError
from treegrpo_ray.hub import resolve_policy_path

PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"
SPECIAL_TOKENS = (PAD, UNK, EOS)  # ids 0, 1, 2


def build_word_tokenizer(
    words: Iterable[str], path: str | Path
) -> transformers.PreTrainedTokenizerFast:
    """A WordLevel tokenizer over ``words`` (after ``<pad>``=0, ``<unk>``=1, ``<eos>``=2).

    Splits on white space only; unknown words map to ``<unk>``; no special tokens are added when
    encoding. Saved with ``save_pretrained(path)`` so ``AutoTokenizer.from_pretrained(path)`` loads
    it.
    """
    vocab = {w: i for i, w in enumerate(dict.fromkeys([*SPECIAL_TOKENS, *words]))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=EOS,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(str(path))
    return tokenizer


def build_tiny_model(
    cfg: TinyModelConfig, vocab_size: int, seed: int
) -> transformers.Qwen2ForCausalLM:
    """A freshly initialised fp32 ``Qwen2ForCausalLM`` with tied embeddings, seeded by ``seed``."""
    config = transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=None,
        use_cache=True,
        dtype="float32",
    )
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config)
    return model.float()


def load_tokenizer(path: str | Path) -> transformers.PreTrainedTokenizerFast:
    """The tokenizer saved in ``path`` (a directory or a Hub id, see ``resolve_policy_path``),
    exactly as its tokenizer.json describes it.

    Unlike ``AutoTokenizer``, never swaps in the model type's own tokenizer class (see the module
    docstring); real checkpoints that ship a tokenizer.json (Qwen2.5, Llama 3) load the same way.
    """
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(resolve_policy_path(path)))


def check_policy_dir(path: str | Path) -> None:
    """Cheap checks of a policy directory or Hub id without loading weights (see
    ``load_policy``); resolves a Hub id on this node (``resolve_policy_path``)."""
    path = resolve_policy_path(path)
    if not (path / "config.json").is_file():
        raise UserInputError(
            f"model.path: {path} has no config.json; it must hold a model saved with "
            "save_pretrained (config.json + weights + tokenizer files)"
        )
    if not (path / "tokenizer.json").is_file():
        raise UserInputError(
            f"model.path: {path} has no tokenizer.json; save the model's tokenizer next to it "
            "(tokenizer.save_pretrained(path))"
        )
    rows = transformers.AutoConfig.from_pretrained(str(path)).vocab_size
    tokens = len(load_tokenizer(path))
    if tokens > rows:
        raise UserInputError(
            f"model.path: tokenizer does not match the model in {path}: {tokens} tokens but only "
            f"{rows} embedding rows; save the tokenizer the model was trained with next to it"
        )


def load_policy(
    path: str | Path,
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from a ``save_pretrained`` directory or a Hugging Face Hub id
    resolved in this node's cache (``resolve_policy_path``), in fp32.

    Raises UserInputError when neither a directory nor a Hub id this node can fetch, when
    config.json or tokenizer.json is missing, or when the tokenizer has more tokens than the
    model has embedding rows (``check_policy_dir``).
    """
    path = resolve_policy_path(path)
    check_policy_dir(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model, load_tokenizer(path)


@dataclass(frozen=True)
class PromptFormat:
    """How a task's prompt text becomes the tree's root tokens (``model.chat_template`` and
    ``model.system_prompt``)."""

    chat_template: bool = False
    system_prompt: str | None = None

    @classmethod
    def of(cls, model: ModelConfig) -> PromptFormat:
        return cls(model.chat_template, model.system_prompt)


def encode_prompt(
    tokenizer: transformers.PreTrainedTokenizerBase, prompt: str, fmt: PromptFormat
) -> list[int]:
    """Token ids of ``prompt``: raw text with the tokenizer's BOS (if it has one), or, with
    ``fmt.chat_template``, a user message (after the system message) rendered by the chat
    template up to the assistant's turn, whose own special tokens replace the BOS."""
    if not fmt.chat_template:
        return list(tokenizer.encode(prompt))
    if not tokenizer.chat_template:
        raise UserInputError(
            "model.chat_template is true but the policy's tokenizer has no chat template; set "
            "model.chat_template=false or use an instruct model's directory"
        )
    messages = [{"role": "user", "content": prompt}]
    if fmt.system_prompt is not None:
        messages.insert(0, {"role": "system", "content": fmt.system_prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(str(text), add_special_tokens=False))
