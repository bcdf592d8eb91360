"""The GPU plan (treegrpo_ray/gpu_plan.py, memory_plan.gpu_learner_plan): a learner rank's terms
by hand, placement of TP groups and learner ranks, verdicts and ``treegrpo plan`` with GPUs. The
constants were fitted on an H200 (benchmarks/results/device_check/: within 0.95-1.03 of the peak,
on a shape they were not fitted on too); here the arithmetic is checked."""

import pytest

from treegrpo_ray.commands.cli import main
from treegrpo_ray.config import JobConfig
from treegrpo_ray.gpu_plan import gpu_plan, place
from treegrpo_ray.memory_plan import GB, ModelSizes, gpu_activation_bytes, gpu_learner_plan

# a made-up 1B-class shape: what the arithmetic reads, nothing else
SIZES = ModelSizes(
    params=10**9,
    linear_params=9 * 10**8,
    layers=10,
    hidden=1000,
    intermediate=4000,
    vocab=50000,
    max_positions=4096,
    kv_token_bytes=2 * 10 * 200 * 4,  # keys + values, 10 layers, 200 wide, float32
    param_bytes=4,
    lora_params=10**7,
)


def _cfg(**sections) -> JobConfig:
    base = {"cluster": {"learner_gpus": 1}, "ppo": {"micro_batch_tokens": 1000}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return JobConfig.model_validate(base)


def test_activations_by_hand():
    # bfloat16-mixed: per layer-token 28 x hidden + 8 x MLP bytes; LM head at 30% of the tokens,
    # 20 bytes per vocabulary entry; bfloat16 copies of the linear weights
    layers = 1000 * 10 * (28 * 1000 + 8 * 4000)
    head = 300 * 50000 * 20
    want = layers + head + 2 * 9 * 10**8
    assert gpu_activation_bytes(SIZES, 1000, "bfloat16-mixed", False, 0.3) == want
    # float32: 40 and 16 bytes, 22 per vocabulary entry, no copies
    f32 = 1000 * 10 * (40 * 1000 + 16 * 4000) + 300 * 50000 * 22
    assert gpu_activation_bytes(SIZES, 1000, "float32", False, 0.3) == f32
    # checkpointing: each layer's float32 input, the head, the LM head's bfloat16 copy
    kept = 1000 * 10 * 1000 * 4 + head + 2 * 50000 * 1000
    assert gpu_activation_bytes(SIZES, 1000, "bfloat16-mixed", True, 0.3) == kept


def test_a_learner_rank_full_and_lora():
    full = gpu_learner_plan(_cfg(ppo={"precision": "bfloat16-mixed"}), SIZES)
    terms = {t.what: t.nbytes for t in full.terms}
    assert terms["weights"] == terms["reference copy"] == 4 * 10**9
    assert terms["gradients and Adam state of the trained parameters"] == 12 * 10**9
    activations = gpu_activation_bytes(SIZES, 1000, "bfloat16-mixed", False, 0.3)
    assert terms["activations of a 1000-token row"] == activations
    # the optimizer step's 4 bytes a parameter exceed these activations: the difference counts
    assert full.nbytes == 4e9 + 12e9 + 4e9 + max(activations, 4 * 10**9)
    no_kl = gpu_learner_plan(_cfg(ppo={"precision": "bfloat16-mixed", "kl_coef": 0.0}), SIZES)
    assert no_kl.nbytes == full.nbytes - 4e9  # no reference copy without a KL term
    lora = gpu_learner_plan(_cfg(model={"lora": {"enabled": True}}), SIZES)
    assert "reference copy" not in {t.what for t in lora.terms}
    assert {t.what: t.nbytes for t in lora.terms}[
        "gradients and Adam state of the trained parameters"
    ] == 12 * 10**7


def _vllm(tp: int, workers: int = 1, learners: int = 1) -> JobConfig:
    return _cfg(
        engine={"kind": "vllm", "vllm": {"device": "cuda", "tensor_parallel_size": tp}},
        cluster={"rollout_workers": workers, "learner_workers": learners},
        train={"prompts_per_step": 12},
    )


def test_tensor_parallel_groups_stay_on_one_node_then_learners_fill_in():
    placed, unplaced = place(_vllm(tp=2, workers=3, learners=2), [4, 4])
    assert [(p.what, p.node, p.first_gpu, p.gpus) for p in placed] == [
        ("rollout engine 0 (TP 2)", 0, 0, 2),
        ("rollout engine 1 (TP 2)", 0, 2, 2),
        ("rollout engine 2 (TP 2)", 1, 0, 2),
        ("learner rank 0", 1, 2, 1),
        ("learner rank 1", 1, 3, 1),
    ]
    assert unplaced == []
    # 3 free GPUs on each of two nodes hold no TP-4 group
    _, unplaced = place(_vllm(tp=4), [3, 3])
    assert unplaced == [
        "rollout engine 0 (TP 4): needs 4 GPU(s) on one node, no node has them left"
    ]


def test_verdicts_and_what_to_change():
    fits = gpu_plan(_vllm(tp=1), SIZES, nodes=1, gpus_per_node=2, gpu_bytes=80 * GB)
    assert fits.fits() and fits.advice == ()
    engine = {t.what.split(" (")[0].split(":")[0]: t.nbytes for t in fits.engine.terms}
    assert engine["weights"] == 4 * 10**9  # engine.vllm.dtype auto: float32, 4 bytes a weight
    small = gpu_plan(_vllm(tp=1), SIZES, nodes=1, gpus_per_node=2, gpu_bytes=16 * GB)
    assert not small.fits()
    assert small.advice[0].startswith("ppo.activation_checkpointing=true")
    assert "DOES NOT FIT" in small.render()
    unplaceable = gpu_plan(_vllm(tp=2), SIZES, nodes=1, gpus_per_node=2, gpu_bytes=80 * GB)
    assert not unplaceable.fits() and "CANNOT BE PLACED" in unplaceable.render()


@pytest.mark.parametrize(
    "args,code,says",
    [
        (["--gpus-per-node", "8", "--nodes", "2"], 0, ["node 0: GPU 0 rollout engine 0", "fits"]),
        (["--gpus-per-node", "8", "--nodes", "2", "--gpu-memory", "40"], 1, ["DOES NOT FIT"]),
        (["--gpus-per-node", "1", "--nodes", "1"], 1, ["CANNOT BE PLACED: learner rank 0"]),
    ],
)
def test_plan_command_for_a_gpu_preset_without_its_weights(capsys, args, code, says):
    assert main(["plan", "qwen2.5-3b-search-r1", *args]) == code
    out = capsys.readouterr().out
    assert "its shape from" in out and "Qwen2.5-3B/config.json" in out
    for text in says:
        assert text in out
