"""The learner in-process: a PPO update on real trees from the tiny policy."""

import math
import shutil
from queue import Empty

import pytest
import torch

from treegrpo_ray.actors.rollout_worker import RolloutWorker
from treegrpo_ray.actors.schedule import Lease
from treegrpo_ray.envs.multihop import MultihopTask
from treegrpo_ray.errors import TrainingStopped
from treegrpo_ray.learners.forward import token_logprobs
from treegrpo_ray.learners.learner import Learner
from treegrpo_ray.packing import pack_trees
from treegrpo_ray.tree import BatchInfo, trees_from_arrow


def _trees(cfg, policy, prompts=8):
    worker = RolloutWorker(policy, cfg.task, cfg.tree, cfg.sampling, seed=0)
    samples = MultihopTask(cfg.task.multihop).train_samples()[:prompts]
    return trees_from_arrow(worker.expand(Lease(0, tuple(enumerate(samples)), seed=5)))


def test_one_update_changes_every_parameter_and_bumps_the_version(tiny_cfg, untrained_policy):
    learner = Learner(untrained_policy, tiny_cfg.ppo, temperature=1.0)
    before = {k: v.clone() for k, v in learner.model.named_parameters()}
    metrics = learner.update(_trees(tiny_cfg, untrained_policy))
    unchanged = [k for k, v in learner.model.named_parameters() if torch.equal(v, before[k])]
    assert unchanged == []
    assert learner.version == 1 and metrics["learner/policy_version"] == 1.0
    assert metrics["tree/leaves"] == 8 * tiny_cfg.tree.shape().leaves_per_prompt
    # the reference policy stays frozen at the starting weights
    for name, param in learner.ref_model.named_parameters():
        assert torch.equal(param, before[name])


@pytest.mark.slow  # needs actions that search and answer: the warm-started policy
def test_micro_batch_size_does_not_change_the_update(tiny_cfg, tiny_policy):
    """Rows of a few trees with gradient accumulation, a row per tree, or trees split over
    rows, give the loss and the gradient of one big row."""
    trees = _trees(tiny_cfg, tiny_policy, prompts=4)
    longest = max(len(t.prefix_ids(leaf.node_id)) for t in trees for leaf in t.leaves())
    # a tree of this preset has at most ~350 tokens
    layouts = ((4096, "many"), (400, "many"), (longest, "many"), (4096, "one"))
    results = []
    for budget, trees_per_row in layouts:
        update = {"micro_batch_tokens": budget, "trees_per_row": trees_per_row}
        learner = Learner(tiny_policy, tiny_cfg.ppo.model_copy(update=update), temperature=1.0)
        metrics = learner.update(trees)
        results.append((metrics, {k: v.grad for k, v in learner.model.named_parameters()}))
    pad = learner.tokenizer.pad_token_id
    rows = [pack_trees(trees, budget, pad, one == "one").num_rows for budget, one in layouts]
    assert rows[0] == 1 and rows[1] >= 3  # the small budget spreads the trees over rows
    assert rows[3] == len(trees)
    (big, big_grads), (small, small_grads), (split, split_grads), (apart, apart_grads) = results
    assert small["learner/split_trees"] == 0 and split["learner/split_trees"] > 0
    # the pieces repeat prompts and shared ancestors; the unique tokens are the same
    assert split["learner/tokens"] == big["learner/tokens"] == big["learner/tokens_forwarded"]
    assert split["learner/tokens_forwarded"] == (
        big["learner/tokens"] + split["learner/split_extra_tokens"]
    )
    assert split["learner/split_extra_tokens"] > 0
    assert apart["learner/tokens_forwarded"] == big["learner/tokens"]
    for metrics, grads in ((small, small_grads), (split, split_grads), (apart, apart_grads)):
        assert metrics["learner/loss"] == pytest.approx(big["learner/loss"], abs=1e-5)
        for name, grad in big_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize(
    "overrides",
    [{"epochs": 2, "minibatches": 2}, {"use_engine_logprobs": True}, {"loss_mode": "mean"}],
)
def test_update_variants_give_finite_metrics(tiny_cfg, untrained_policy, overrides):
    learner = Learner(untrained_policy, tiny_cfg.ppo.model_copy(update=overrides), temperature=1.0)
    metrics = learner.update(_trees(tiny_cfg, untrained_policy, prompts=4))
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["learner/policy_version"] == 1.0 and metrics["learner/grad_norm"] > 0


def test_engine_logprobs_match_the_learner_recomputation(tiny_cfg, untrained_policy):
    """The rollout's behaviour log-probs equal the learner's forward on the same tokens."""
    from treegrpo_ray.packing import expand_paths

    learner = Learner(untrained_policy, tiny_cfg.ppo, temperature=1.0)
    batch = expand_paths(
        _trees(tiny_cfg, untrained_policy, prompts=4), learner.tokenizer.pad_token_id
    )
    with torch.no_grad():
        logprobs, _ = token_logprobs(learner.model, batch.input_ids, batch.attention_mask)
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(logprobs[mask], batch.behaviour_logprobs[mask], atol=1e-4, rtol=0)


class ListQueue:
    """Test double for TreeQueue: hands out prepared tables in order (no Ray needed)."""

    def __init__(self, tables):
        self.tables = list(tables)

    def get(self, timeout=None):
        if not self.tables:
            raise Empty  # as queue.Queue does once ``timeout`` has passed
        return self.tables.pop(0)


def _table(version, group_ids):
    from treegrpo_ray.budget import Budget
    from treegrpo_ray.tree import ROOT, Tree, trees_to_arrow

    trees = []
    for g in group_ids:
        tree = Tree(tree_id=g, group_id=g, prompt_ids=[1])
        tree.add(
            ROOT,
            action_ids=[2],
            action_logprobs=[-0.5],
            obs_ids=[],
            finished=True,
            finish_reason="done",
            policy_version=version,
            role="answer",
            tool_call=False,
            reward=1.0,
        )
        trees.append(tree)
    budgets = {
        g: Budget(generated_tokens=1, leaves=1, prefill_tokens=1 + g, cached_tokens=3)
        for g in group_ids
    }
    return trees_to_arrow(trees, BatchInfo(0, version, budgets, rollout_seconds=0.5))


def test_pull_batch_refuses_trees_older_than_the_lag():
    from treegrpo_ray.learners.intake import pull_batch

    queue = ListQueue([_table(3, [0, 1]), _table(4, [2, 3]), _table(5, [4, 5])])
    intake = pull_batch(queue, groups_needed=4, version=5, max_lag=1)
    metrics = intake.metrics()
    # version 3 < 5 - 1 is dropped (2 groups); versions 4 and 5 make up the 4 groups
    assert [t.group_id for t in intake.trees] == [2, 3, 4, 5]
    assert intake.dropped_stale_groups == metrics["tree/dropped_stale_groups"] == 2
    assert intake.staleness == metrics["tree/staleness"] == 0.5  # 2 trees 1 behind, 2 current
    assert metrics["budget/generated_tokens"] == 4
    assert metrics["rollout/seconds"] == 1.0
    # prefix work of the kept groups 2..5: computed 3+4+5+6, served from the cache 4 x 3
    assert metrics["rollout/prefill_tokens"] == 18
    assert metrics["rollout/cached_tokens"] == 12
    assert metrics["rollout/cache_hit_rate"] == 12 / 30
    assert queue.tables == []


def test_pull_batch_stops_training_when_no_trees_arrive_in_time():
    from treegrpo_ray.learners.intake import pull_batch

    with pytest.raises(TrainingStopped, match=r"no trees arrived for 5 s \(update 6 had 2 of 4"):
        pull_batch(
            ListQueue([_table(5, [0, 1])]), groups_needed=4, version=5, max_lag=0, timeout_s=5
        )


def test_non_finite_updates_are_skipped_and_three_in_a_row_stop_the_run(tiny_cfg, untrained_policy):

    trees = _trees(tiny_cfg, untrained_policy, prompts=2)
    poisoned = _trees(tiny_cfg, untrained_policy, prompts=2)
    poisoned[0].leaves()[0].reward = float("nan")  # NaN advantages -> NaN loss
    learner = Learner(untrained_policy, tiny_cfg.ppo, temperature=1.0)
    before = {k: v.clone() for k, v in learner.model.named_parameters()}
    skipped = learner.update(poisoned)
    assert skipped["learner/skipped_updates"] == 1.0 and learner.version == 1
    assert all(torch.equal(v, before[k]) for k, v in learner.model.named_parameters())
    assert learner.update(trees)["learner/skipped_updates"] == 1.0  # a good one resets the streak
    learner.update(poisoned)
    learner.update(poisoned)
    with pytest.raises(TrainingStopped, match="3 updates in a row had a non-finite loss"):
        learner.update(poisoned)
    assert learner.skipped_updates == 4


def test_lora_trains_only_the_adapter_and_the_reference_is_the_base_model(
    tiny_cfg, untrained_policy
):
    from treegrpo_ray.config import LoraSettings
    from treegrpo_ray.engine import LoraPayload
    from treegrpo_ray.learners.forward import packed_logprobs
    from treegrpo_ray.modeling import load_policy
    from treegrpo_ray.packing import pack_trees

    lora = LoraSettings(enabled=True, rank=8, alpha=16)
    learner = Learner(untrained_policy, tiny_cfg.ppo, temperature=1.0, lora=lora)
    before = {k: v.clone() for k, v in learner.model.named_parameters()}
    trees = _trees(tiny_cfg, untrained_policy, prompts=2)
    for _ in range(2):  # B starts at zero: the second update is the first to move A
        learner.update(trees)
    changed = {k for k, v in learner.model.named_parameters() if not torch.equal(v, before[k])}
    assert changed and all("lora_" in k for k in changed)
    assert {k for k in before if "lora_" in k} == changed  # every adapter tensor moved

    batch = pack_trees(trees, 4096, learner.tokenizer.pad_token_id)
    base, _ = load_policy(untrained_policy)
    with torch.no_grad():
        want = packed_logprobs(base, batch, 0)[0]
    # the learner's reference pass runs through oneDNN on CPU, the base model through torch
    torch.testing.assert_close(learner._reference_logprobs(batch)[0], want, atol=1e-5, rtol=0)
    trained = learner._no_grad_logprobs(learner.model, batch)[0]
    assert (trained - want).abs().max() > 1e-3  # the adapter's policy is told apart

    payload = learner.policy_state()
    assert isinstance(payload, LoraPayload)
    assert payload.adapter_state and all("lora_" in k for k in payload.adapter_state)


def test_merged_lora_weights_are_the_policy_the_adapter_gives(tiny_cfg, untrained_policy):
    """engine.vllm.lora_updates=merged: vLLM gets the base weights with the adapter added, a
    plain state dict with the base model's names whose model computes what the trained adapter
    does; the learner's model (and so its reference) is left as it was."""
    from treegrpo_ray.config import LoraSettings
    from treegrpo_ray.engine import LoraPayload
    from treegrpo_ray.learners.forward import packed_logprobs
    from treegrpo_ray.modeling import load_policy

    learner = Learner(
        untrained_policy, tiny_cfg.ppo, temperature=1.0, lora=LoraSettings(enabled=True, rank=8)
    )
    trees = _trees(tiny_cfg, untrained_policy, prompts=2)
    for _ in range(2):
        learner.update(trees)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    vllm = tiny_cfg.engine.vllm.model_copy(update={"lora_updates": "merged"})
    merged_engine = tiny_cfg.engine.model_copy(update={"kind": "vllm", "vllm": vllm})
    merged = learner.engine_state(merged_engine)
    assert isinstance(learner.engine_state(tiny_cfg.engine), LoraPayload)  # the embedded engine
    assert all(torch.equal(v, before[k]) for k, v in learner.model.state_dict().items())

    plain, _ = load_policy(untrained_policy)
    assert merged.keys() == plain.state_dict().keys()
    plain.load_state_dict(merged)
    batch = pack_trees(trees, 4096, learner.tokenizer.pad_token_id)
    with torch.no_grad():
        want = packed_logprobs(learner.model, batch, 0)[0]
        got = packed_logprobs(plain, batch, 0)[0]
        base = learner._reference_logprobs(batch)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not torch.allclose(got, base, atol=1e-3)  # the adapter really changed the policy


def test_bfloat16_mixed_keeps_float32_state_and_follows_the_float32_update(
    tiny_cfg, untrained_policy
):
    """bfloat16-mixed: the forwards run under bfloat16 autocast, while weights, gradients and
    Adam's moments stay float32 (verl's and OpenRLHF's mixed precision); its loss and gradient
    follow the float32 update's within bfloat16's precision."""
    trees = _trees(tiny_cfg, untrained_policy, prompts=4)
    results = {}
    for precision in ("float32", "bfloat16-mixed"):
        ppo = tiny_cfg.ppo.model_copy(update={"precision": precision})
        learner = Learner(untrained_policy, ppo, temperature=1.0, device="cpu")
        metrics = learner.update(trees)
        grads = torch.cat([p.grad.flatten() for p in learner.model.parameters()])
        results[precision] = (metrics, grads, learner)
    (full, full_grads, _), (mixed, mixed_grads, learner) = results.values()
    assert {p.dtype for p in learner.model.parameters()} == {torch.float32}
    assert mixed_grads.dtype == torch.float32
    moments = [s["exp_avg"] for s in learner.optimizer.state.values()]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    assert mixed["learner/loss"] == pytest.approx(full["learner/loss"], abs=0.02)
    cosine = torch.nn.functional.cosine_similarity(mixed_grads, full_grads, dim=0)
    assert cosine > 0.95 and not torch.equal(mixed_grads, full_grads)  # autocast really ran


def test_weights_go_to_the_engine_in_its_dtype(tiny_cfg, untrained_policy):
    """A bfloat16 vLLM engine is sent bfloat16 weights (half the bytes), the embedded engine and
    vLLM's auto dtype float32; both are copies, detached from the training weights."""
    learner = Learner(untrained_policy, tiny_cfg.ppo, temperature=1.0)
    vllm_bf16 = tiny_cfg.engine.model_copy(update={"kind": "vllm"})
    vllm_bf16 = vllm_bf16.model_copy(
        update={"vllm": vllm_bf16.vllm.model_copy(update={"dtype": "bfloat16"})}
    )
    assert (tiny_cfg.engine.weights_dtype(), vllm_bf16.weights_dtype()) == ("float32", "bfloat16")
    weights = dict(learner.model.state_dict())
    for dtype in ("float32", "bfloat16"):
        sent = learner.policy_state(dtype)
        assert sent.keys() == weights.keys()
        for name, tensor in sent.items():
            assert tensor.dtype == getattr(torch, dtype) and not tensor.requires_grad
            assert torch.equal(tensor, weights[name].to(tensor.dtype))
            assert tensor.data_ptr() != weights[name].data_ptr()


def _updates_off_and_on(tiny_cfg, policy, lora, setting, watch, values=(False, True)):
    """One update of 4 prompts' trees by a fresh learner with ``ppo.<setting>`` off, then on
    (or at each of ``values``): per arm ``(metrics, gradients of the trainable parameters,
    watched)``, where ``watch(learner)``, called before the update, returns what to call after
    it."""
    from treegrpo_ray.config import LoraSettings

    trees = _trees(tiny_cfg, policy, prompts=4)
    results = []
    for value in values:
        ppo = tiny_cfg.ppo.model_copy(update={setting: value})
        learner = Learner(policy, ppo, temperature=1.0, lora=LoraSettings(enabled=lora, rank=8))
        watched = watch(learner)
        metrics = learner.update(trees)
        grads = {k: p.grad for k, p in learner.model.named_parameters() if p.requires_grad}
        results.append((metrics, grads, watched()))
    return results


@pytest.mark.parametrize("lora", [False, True])
def test_without_a_kl_term_the_reference_pass_is_skipped_and_the_update_is_the_same(
    tiny_cfg, untrained_policy, lora, monkeypatch
):
    from treegrpo_ray.config import LoraSettings
    from treegrpo_ray.config.schema import ModifiersConfig, PPOConfig

    trees = _trees(tiny_cfg, untrained_policy, prompts=4)
    ppo = tiny_cfg.ppo.model_copy(update={"kl_coef": 0.0})
    settings = LoraSettings(enabled=lora, rank=8)
    with monkeypatch.context() as patched:
        patched.setattr(PPOConfig, "uses_reference", lambda self: True)  # the pass, at weight 0
        forced = Learner(untrained_policy, ppo, temperature=1.0, lora=settings)
    skipping = Learner(untrained_policy, ppo, temperature=1.0, lora=settings)
    assert forced.reference and not skipping.reference and skipping.ref_model is None
    with_pass, without = forced.update(trees), skipping.update(trees)
    assert "learner/kl" in with_pass and "learner/kl" not in without
    assert without["learner/loss"] == with_pass["learner/loss"]
    for (name, want), (_, got) in zip(
        forced.model.named_parameters(), skipping.model.named_parameters(), strict=True
    ):
        assert torch.equal(got, want), name
    # a role's own KL coefficient still needs the reference
    role_kl = ppo.model_copy(update={"modifiers": ModifiersConfig(role_kl_coef={"search": 0.1})})
    assert role_kl.uses_reference()


def _grad_mode_calls_of_layer_0(learner):
    calls = []
    learner.model.get_decoder().layers[0].register_forward_pre_hook(
        lambda *_: calls.append(torch.is_grad_enabled())
    )
    return lambda: calls.count(True)


@pytest.mark.parametrize("lora", [False, True])
def test_activation_checkpointing_recomputes_layers_and_keeps_loss_and_gradients(
    tiny_cfg, untrained_policy, lora
):
    (plain, plain_grads, plain_calls), (saved, saved_grads, saved_calls) = _updates_off_and_on(
        tiny_cfg, untrained_policy, lora, "activation_checkpointing", _grad_mode_calls_of_layer_0
    )
    # the backward started the layer's forward once more per row (recomputation stops early)
    assert saved_calls == 2 * plain_calls > 0
    assert saved["learner/loss"] == pytest.approx(plain["learner/loss"], abs=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(saved_grads[name], grad, atol=1e-6, rtol=0, msg=name)


def test_flex_attention_on_a_cpu_learner_is_refused_with_the_fix(tiny_cfg, untrained_policy):
    from treegrpo_ray.errors import UserInputError

    ppo = tiny_cfg.ppo.model_copy(update={"attention": "flex"})
    with pytest.raises(UserInputError, match="ppo.attention=flex.*CUDA.*auto or sdpa"):
        Learner(untrained_policy, ppo, temperature=1.0, device="cpu")


def test_the_cpu_block_attention_on_a_cuda_learner_is_refused_with_the_fix():
    from treegrpo_ray.errors import UserInputError
    from treegrpo_ray.learners.forward import attention_implementation

    with pytest.raises(UserInputError, match="ppo.attention=blocks.*CPU.*auto or flex"):
        attention_implementation("blocks", torch.device("cuda"))


@pytest.mark.parametrize("lora", [False, True])
def test_block_attention_gives_the_dense_masks_loss_and_gradients(
    tiny_cfg, untrained_policy, lora, monkeypatch
):
    from treegrpo_ray import tree_attention

    chunks_per_call = []

    def chunk_counts(learner):
        def counted(*plan):
            chunks = real(*plan)
            chunks_per_call.append(len(chunks))
            return chunks

        real = tree_attention._chunks
        monkeypatch.setattr(tree_attention, "_chunks", counted)
        return lambda: max(chunks_per_call, default=0)

    (dense, dense_grads, _), (blocks, blocks_grads, most_chunks) = _updates_off_and_on(
        tiny_cfg, untrained_policy, lora, "attention", chunk_counts, values=("sdpa", "blocks")
    )
    # some rows were cut into chunks that skip hidden blocks, not all run as one dense chunk
    assert most_chunks > 1
    assert blocks["learner/loss"] == pytest.approx(dense["learner/loss"], abs=1e-6)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(blocks_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def _graphs_compiled(learner):
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    return lambda: counters["stats"]["unique_graphs"] - before


@pytest.mark.slow  # inductor compiles a layer's forward and backward: ~20 s each on 2 cores
@pytest.mark.skipif(shutil.which("c++") is None, reason="inductor builds CPU kernels with c++")
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("attention", ["sdpa", "blocks"])
def test_compiled_layers_give_the_eager_loss_and_gradients_from_one_graph(
    tiny_cfg, untrained_policy, lora, attention
):
    ppo = tiny_cfg.ppo.model_copy(update={"attention": attention})
    (eager, eager_grads, eager_graphs), (compiled, compiled_grads, graphs) = _updates_off_and_on(
        tiny_cfg.model_copy(update={"ppo": ppo}),
        untrained_policy,
        lora,
        "compile_layers",
        _graphs_compiled,
    )
    # one graph serves every layer: per grad mode and input (a LoRA policy: its reference pass,
    # adapter off; layer 0's input from the frozen embedding; the later layers'), not per layer;
    # block attention's custom op is one node of it
    assert eager_graphs == 0 and graphs == (3 if lora else 1)
    assert compiled["learner/loss"] == pytest.approx(eager["learner/loss"], abs=1e-5)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_compiled_layers_without_a_cpp_compiler_are_refused_with_the_fix(
    tiny_cfg, untrained_policy, tmp_path, monkeypatch
):
    from treegrpo_ray.errors import UserInputError

    monkeypatch.setenv("PATH", str(tmp_path))  # a node without c++
    ppo = tiny_cfg.ppo.model_copy(update={"compile_layers": True})
    with pytest.raises(UserInputError, match="C\\+\\+ compiler.*ppo.compile_layers=false"):
        Learner(untrained_policy, ppo, temperature=1.0)
