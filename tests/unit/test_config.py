"""Presets and ``extends``: a config file that overrides another one's fields; reading a config
without the runtime; the vLLM build resolved once, where the config is read."""

import os
import subprocess
import sys

import pytest

from treegrpo_ray.config import installed_vllm_build, load_config, preset_names, save_run_config
from treegrpo_ray.config.resume import changed_fields, resume_config
from treegrpo_ray.errors import UserInputError


def test_every_preset_loads():
    assert {"tiny-multihop", "tiny-multihop-lora"} <= set(preset_names())
    for name in preset_names():
        assert load_config(name).name == name


def test_the_lora_preset_differs_from_its_base_only_where_it_says():
    base = load_config("tiny-multihop").model_dump(mode="json")
    lora = load_config("tiny-multihop-lora").model_dump(mode="json")
    changed = changed_fields(base, lora)
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


def test_required_resources_count_every_worker_and_the_simulated_engine_stands_in():
    cfg = load_config(
        "tiny-multihop",
        [
            "engine.kind=vllm",
            "engine.vllm.device=cuda",
            "engine.vllm.tensor_parallel_size=2",
            "cluster.rollout_workers=2",
            "cluster.rollout_cpus=0.5",
            "cluster.rollout_resources={rollout_node: 1}",
            "cluster.learner_workers=2",
            "cluster.learner_gpus=1",
        ],
    )
    assert cfg.rollout_worker_resources() == {"CPU": 0.5, "rollout_node": 1, "GPU": 2}
    # CPU 2 * 0.5 + 2 * 1 learner CPUs; GPU 2 * 2 + 2 * 1
    assert cfg.required_resources() == {"CPU": 3, "rollout_node": 2, "GPU": 6}
    assert cfg.required_resources(rollout_workers=1) == {"CPU": 2.5, "rollout_node": 1, "GPU": 4}
    assert cfg.worker_engine() == cfg.engine  # a real run: vLLM
    simulated = cfg.model_copy(
        update={"cluster": cfg.cluster.model_copy(update={"simulated_gpus": True})}
    )
    assert simulated.worker_engine().kind == "hf"
    assert simulated.required_resources() == cfg.required_resources()  # Ray still places vLLM


def test_reading_and_validating_every_preset_imports_no_runtime():
    code = (
        "import sys\n"
        "from treegrpo_ray.config import load_config, preset_names\n"
        "for name in preset_names():\n"
        "    load_config(name, ['engine.kind=vllm'])\n"
        "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'ray') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_vllm_device_is_resolved_on_reading_and_saved_with_the_run(tmp_path):
    build_device = "cpu" if installed_vllm_build() == "cpu" else "cuda"
    cfg = load_config("tiny-multihop", ["engine.kind=vllm", f"train.output_dir={tmp_path}"])
    assert cfg.engine.vllm.device == build_device  # "auto" in the preset
    save_run_config(cfg)
    assert f"device: {build_device}" in (cfg.run_dir / "config.yaml").read_text()
    assert resume_config(cfg.run_dir, None).engine.vllm.device == build_device
    explicit = load_config("tiny-multihop", ["engine.vllm.device=cuda"])
    assert explicit.engine.vllm.device == "cuda"


@pytest.mark.parametrize(
    ("device", "sent", "adapters"),
    [
        ("cpu", "auto", False),  # the CPU build's LoRA kernels were the slower (issue 27)
        ("cuda", "auto", True),
        ("cpu", "adapter", True),
        ("cuda", "merged", False),
    ],
)
def test_a_lora_policy_reaches_vllm_as_adapters_or_merged_weights(device, sent, adapters):
    cfg = load_config(
        "tiny-multihop-lora",
        ["engine.kind=vllm", f"engine.vllm.device={device}", f"engine.vllm.lora_updates={sent}"],
    )
    assert cfg.engine.adapter_updates(lora=True) is adapters
    assert cfg.engine.adapter_updates(lora=False) is False
    hf = load_config("tiny-multihop-lora", [f"engine.vllm.lora_updates={sent}"])
    assert hf.engine.adapter_updates(lora=True) is True  # the embedded engine merges them itself


def test_processes_that_take_turns_spin_briefly_and_processes_side_by_side_sleep_at_once(
    monkeypatch,
):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    policy = os.environ["OMP_WAIT_POLICY"]  # the package's PASSIVE unless the user set one
    turns = load_config("smollm2-135m-search-qa")  # one rollout worker, one learner, lag 0
    assert turns.omp_env() == {"OMP_WAIT_POLICY": policy, "GOMP_SPINCOUNT": "100000"}
    side_by_side = [["train.max_policy_lag=1"], ["cluster.rollout_workers=2"]]
    side_by_side += [["cluster.learner_workers=2"]]
    for overrides in side_by_side:
        assert load_config("smollm2-135m-search-qa", overrides).omp_env()["GOMP_SPINCOUNT"] == "0"
    chosen = load_config("smollm2-135m-search-qa", ["cluster.omp_spin_count=5000"])
    assert chosen.omp_spin_count() == 5000
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")  # the user's own, inherited by every process
    assert turns.omp_env() == {"OMP_WAIT_POLICY": policy}
