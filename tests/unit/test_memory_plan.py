"""The CPU memory plan (treegrpo_ray/memory_plan.py, cluster/plan.py): sizes hand-computed for
the tiny Qwen2, the engine's and learner's terms, the refusal and ``treegrpo plan``."""

from treegrpo_ray.commands.cli import main
from treegrpo_ray.config import JobConfig, LoraSettings, TinyModelConfig
from treegrpo_ray.learners.learner import with_lora_adapter
from treegrpo_ray.memory_plan import (
    GB,
    ModelSizes,
    NodePlan,
    RolloutLoad,
    expected_rollout_worker,
    local_node_plan,
)
from treegrpo_ray.modeling import build_tiny_model

LORA = LoraSettings(enabled=True, rank=2)


def _tiny():
    return build_tiny_model(TinyModelConfig(), vocab_size=100, seed=0)


def test_sizes_of_the_tiny_qwen2_by_hand():
    """hidden 128, 2 layers, 4 heads of 32 (2 for keys and values), MLP 512, vocab 100."""
    sizes = ModelSizes.of(_tiny().config, LORA)
    per_layer = 128 * 128 * 2 + 128 * 64 * 2 + 128 * 512 * 3  # q, o; k, v; gate, up, down
    assert sizes.linear_params == 2 * per_layer + 100 * 128  # the tied LM head counted
    biases_norms = 128 + 64 + 64 + 2 * 128  # q/k/v biases, two norms
    assert sizes.params == 100 * 128 + 2 * (per_layer + biases_norms) + 128
    assert sizes.kv_token_bytes == 2 * 2 * 2 * 32 * 4
    adapter = 2 * (256 + 192 + 192 + 256 + 640 + 640 + 640)  # rank x (in + out), per layer
    assert sizes.lora_params == 2 * adapter


def test_the_adapter_size_is_what_peft_trains():
    model = with_lora_adapter(_tiny(), LORA)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert ModelSizes.of(model.config, LORA).lora_params == trained


def test_engine_and_learner_terms_follow_the_settings():
    sizes = ModelSizes.of(_tiny().config, LORA)
    cfg = JobConfig.model_validate(
        {
            "model": {"lora": {"enabled": True, "rank": 2}},
            "engine": {"max_kv_bytes": 10**6, "cache_bytes": 2 * 10**6},
            "ppo": {"micro_batch_tokens": 256},
            "cluster": {"rollout_workers": 2, "torch_threads": 1},
            "train": {"prompts_per_step": 4},
        }
    )
    plan = local_node_plan(cfg, sizes, node_bytes=64 * GB)
    rollout, learner = plan.processes
    assert rollout.count == 2 and learner.count == 1
    terms = {t.what: t.nbytes for t in rollout.terms}
    assert terms["running rows' KV bound"] == 10**6  # under max_num_seqs x 513 x 1 KiB
    assert terms["prefix cache budget"] == 2 * 10**6
    assert terms["freed memory glibc keeps (cache churn)"] == 2 * 10**6  # at most the cache
    assert terms["oneDNN-packed linear weights"] == 4 * sizes.linear_params
    learned = {t.setting: t.nbytes for t in learner.terms if t.setting}
    assert learned["model.lora"] == 16 * sizes.lora_params
    assert learned["ppo.onednn_linears"] == 2 * 4 * sizes.linear_params
    per_token = 2 * (14 * 128 + 5 * 512) + 6 * 100
    assert learned["ppo.micro_batch_tokens"] == 256 * per_token * 4 + 256 * 256
    assert plan.fits()


def test_a_job_over_the_node_is_refused_with_the_largest_settings():
    sizes = ModelSizes.of(_tiny().config, LORA)
    cfg = JobConfig.model_validate({"engine": {"max_kv_bytes": 20 * GB, "max_num_seqs": 10**6}})
    plan = local_node_plan(cfg, sizes, node_bytes=16 * GB)
    assert isinstance(plan, NodePlan) and not plan.fits()
    refusal = plan.refusal()
    assert refusal.startswith("the job needs ~")
    assert "engine.max_kv_bytes (running rows' KV bound: 20.00 GB)" in refusal


def test_plan_command_prints_the_table_and_says_whether_it_fits(tmp_path, capsys):
    _tiny().config.save_pretrained(tmp_path)
    assert main(["plan", "tiny-multihop", "--set", f"model.path={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "rollout worker x1" in out and "learner rank x1" in out and ": fits" in out
    too_big = ["--set", "engine.max_kv_bytes=100000000000000", "--set", "engine.max_num_seqs=99999"]
    assert main(["plan", "tiny-multihop", "--set", f"model.path={tmp_path}", *too_big]) == 1
    assert "does NOT fit" in capsys.readouterr().out


def test_the_kv_term_is_the_slots_when_max_model_len_binds_first():
    sizes = ModelSizes.of(_tiny().config, LORA)
    cfg = JobConfig.model_validate({"engine": {"max_model_len": 100, "max_kv_bytes": GB}})
    rollout = local_node_plan(cfg, sizes, node_bytes=64 * GB).processes[0]
    kv = [t for t in rollout.terms if t.what == "running rows' KV bound"][0]
    assert kv.nbytes == 64 * 101 * 1024  # max_num_seqs x (max_model_len + 1) x KV per token
    assert kv.setting == "engine.max_num_seqs x max_model_len"


def test_train_refuses_a_local_job_over_the_node_before_ray_starts(
    untrained_policy, tmp_path, capsys
):
    import ray

    over = ["engine.max_kv_bytes=100000000000000", "engine.max_num_seqs=99999"]
    sets = [f"model.path={untrained_policy}", f"train.output_dir={tmp_path}", *over]
    args = ["train", "tiny-multihop", "--quiet", *(x for s in sets for x in ("--set", s))]
    assert main(args) == 2
    error = capsys.readouterr().err
    assert "Ray starts killing workers" in error and "engine.max_num_seqs" in error
    assert not ray.is_initialized() and not any(tmp_path.iterdir())


def _two_leaf_tree():
    """A 10-token prompt; node 0 (3 action + 4 observation tokens) with leaf 1 (2 tokens) below
    it, and leaf 2 (5 tokens) under the root."""
    from treegrpo_ray.tree import ROOT, Tree

    tree = Tree(tree_id=0, group_id=0, prompt_ids=list(range(10)))
    step = {"action_logprobs": [], "finish_reason": "", "policy_version": 0}
    step |= {"role": "assistant", "tool_call": False}
    tree.add(ROOT, action_ids=[1, 2, 3], obs_ids=[4, 5, 6, 7], finished=False, **step)
    tree.add(0, action_ids=[1, 2], obs_ids=[], finished=True, **step)
    tree.add(ROOT, action_ids=[1, 2, 3, 4, 5], obs_ids=[], finished=True, **step)
    return tree


def test_a_load_counts_unique_flat_and_longest_tokens_by_hand():
    load = RolloutLoad.of_trees([_two_leaf_tree()])
    assert load == RolloutLoad(
        leaves=2, unique_tokens=10 + 7 + 2 + 5, path_tokens=19 + 15, longest_tokens=19
    )


def test_the_expected_worker_scales_the_load_to_the_lease_and_the_evaluation():
    sizes = ModelSizes.of(_tiny().config, LORA)  # 1 KiB of KV a token
    load = RolloutLoad.of_trees([_two_leaf_tree()])
    settings = {
        "tree": {"m": 1, "n": 2, "l": 1},  # 3 leaves a prompt, 4 prompts: 12 leaves a lease
        "train": {"prompts_per_step": 4, "final_eval_questions": 100},
        "engine": {"cache_bytes": 2 * 10**6, "max_kv_bytes": GB},
    }
    cfg = JobConfig.model_validate(settings)
    lease = expected_rollout_worker(cfg, sizes, 1, load, evaluation=False)
    terms = {t.what: t.nbytes for t in lease.terms}
    assert terms["prefix cache fill"] == 12 * 24 // 2 * 1024  # unique tokens a leaf, 12 leaves
    assert terms["running rows' KV"] == 12 * 23 * 1024  # 12 slots of 1.25 x 19 columns
    assert "freed memory glibc keeps (cache churn)" not in terms  # the cache never evicts
    evaluated = {t.what: t.nbytes for t in expected_rollout_worker(cfg, sizes, 1, load).terms}
    assert evaluated["prefix cache fill"] == 100 * 34 // 2 * 1024  # 100 chains, flat paths
    assert evaluated["running rows' KV"] == 64 * 23 * 1024  # max_num_seqs of the 100 at once
    settings["engine"]["cache_bytes"] = 10**6
    evicting = JobConfig.model_validate(settings)
    terms = {t.what: t.nbytes for t in expected_rollout_worker(evicting, sizes, 1, load).terms}
    assert terms["prefix cache fill"] == 10**6
    assert terms["freed memory glibc keeps (cache churn)"] == 10**6


def test_plan_with_a_runs_trees_prints_the_expected_worker(tmp_path, capsys):
    from treegrpo_ray.saved_trees import NodeAdvantage, saved_trees_table, write_saved_trees

    _tiny().config.save_pretrained(tmp_path / "policy")
    tree = _two_leaf_tree()
    advantages = {(0, n.node_id): NodeAdvantage(None, (0.0,)) for n in tree.nodes}
    table = saved_trees_table([tree], advantages, lambda ids: "", {"step": 1})
    write_saved_trees(tmp_path / "run", 1, table)
    args = ["plan", "tiny-multihop", "--set", f"model.path={tmp_path / 'policy'}"]
    assert main([*args, "--trees", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "(update 1: 2 leaves, longest 19 tokens)" in out
    assert "rollout worker (expected at this load) x1" in out
    assert main([*args, "--trees", str(tmp_path)]) == 2
    assert "holds no saved trees" in capsys.readouterr().err
