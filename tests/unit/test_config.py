"""Presets and ``extends``: a config file that overrides another one's fields."""

import pytest

from treegrpo_ray.config import _changed_fields, load_config, preset_names
from treegrpo_ray.errors import UserInputError


def test_every_preset_loads():
    assert {"tiny-multihop", "tiny-multihop-lora"} <= set(preset_names())
    for name in preset_names():
        assert load_config(name).name == name


def test_the_lora_preset_differs_from_its_base_only_where_it_says():
    base = load_config("tiny-multihop").model_dump(mode="json")
    lora = load_config("tiny-multihop-lora").model_dump(mode="json")
    changed = _changed_fields(base, lora)
    assert sorted(changed) == ["model.lora.enabled", "name", "ppo.lr"]  # rank 8, alpha 16: defaults
    assert lora["model"]["lora"]["rank"] == 8 and lora["model"]["lora"]["alpha"] == 16


def test_a_user_file_extends_a_preset_and_overrides_win(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("extends: tiny-multihop-lora\ntree: {n: 0}\nmodel: {lora: {rank: 4}}\n")
    cfg = load_config(str(path), ["ppo.lr=0.01"])
    assert (cfg.tree.m, cfg.tree.n) == (2, 0)  # m from the preset, n from the file
    assert (cfg.model.lora.enabled, cfg.model.lora.rank, cfg.ppo.lr) == (True, 4, 0.01)


@pytest.mark.parametrize(
    "overrides, refused",
    [
        (["sampling.top_p=0.9"], False),  # on-policy, recomputed old log-probs: no engine ratio
        (["sampling.top_p=0.9", "ppo.use_engine_logprobs=true"], True),
        (["sampling.top_p=0.9", "train.max_policy_lag=1"], True),  # the IS correction reads them
        (["sampling.top_p=0.9", "train.max_policy_lag=1", "ppo.is_cap=0"], False),
        (["train.max_policy_lag=1", "ppo.use_engine_logprobs=true"], False),  # top-p 1
    ],
)
def test_top_p_below_one_is_refused_where_the_ratio_reads_engine_logprobs(overrides, refused):
    if not refused:
        load_config("tiny-multihop", overrides)
        return
    with pytest.raises(UserInputError, match=r"sampling.top_p 0.9 < 1 with .*set sampling.top_p=1"):
        load_config("tiny-multihop", overrides)
