"""RolloutWorker: engine + environment + planner; expands the trees of leased prompt groups.

A plain class: a unit test drives it in-process, ``cluster/`` runs it as a Ray actor. ``expand``
returns the trees as one Arrow table whose metadata carries the lease id, the per-group budgets and
rollout timings.
"""

from __future__ import annotations

import random
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import cast

import pyarrow as pa
import torch

from treegrpo_ray.actors.engines.hf_engine import HFEngine
from treegrpo_ray.actors.retriever import Retriever
from treegrpo_ray.actors.schedule import Lease, LeaseReceipt
from treegrpo_ray.budget import Budget
from treegrpo_ray.config import EngineConfig, JobConfig, SamplingConfig, TaskConfig, TreeConfig
from treegrpo_ray.engine import (
    Engine,
    EngineCounters,
    GenerationRequest,
    GenerationResult,
    LoraPayload,
    SamplingParams,
    stepped,
)
from treegrpo_ray.envs.base import AgentEnv, Sample, StepResult
from treegrpo_ray.envs.multihop import MultihopEnv, MultihopTask
from treegrpo_ray.envs.search_qa import SearchFn, SearchQAEnv
from treegrpo_ray.metrics import peak_rss_bytes
from treegrpo_ray.modeling import PromptFormat, encode_prompt, load_policy, load_tokenizer
from treegrpo_ray.planner import Expansion, TreePlanner
from treegrpo_ray.stops import Decode, StopStrings
from treegrpo_ray.tree import AgentStep, BatchInfo, Tree, batch_info, trees_to_arrow


def make_env(task: TaskConfig, search: SearchFn | None = None) -> AgentEnv:
    """The environment named by the task config.

    search_qa searches with ``search`` when given (``cluster/`` passes the retriever actor's
    client), else with a ``Retriever`` built here from the configured corpus or the fixture.
    """
    if task.name == "search_qa":
        if search is None:
            search = Retriever.from_config(task.search_qa).search_batch
        return SearchQAEnv(task.search_qa, search)
    return MultihopEnv(MultihopTask(task.multihop))


def make_engine(
    model_path: str, engine: EngineConfig, seed: int, lora: bool = False, workers_on_node: int = 1
) -> Engine:
    """The rollout engine named by the config, loaded from the policy directory; ``lora``: the
    learner sends LoRA adapters (vLLM must know at start-up); ``workers_on_node``: rollout
    workers that share this node's default KV budget (``EngineConfig.kv_budget``)."""
    if engine.kind == "vllm":
        from treegrpo_ray.actors.engines.vllm_engine import VLLMEngine

        return VLLMEngine(
            model_path, engine.vllm, seed=seed, prefix_cache=engine.prefix_cache, enable_lora=lora
        )
    model, tokenizer = load_policy(model_path)
    cache_bytes = engine.cache_bytes if engine.prefix_cache else 0
    return HFEngine(
        model,
        tokenizer.pad_token_id,
        seed=seed,
        cache_bytes=cache_bytes,
        max_num_seqs=engine.max_num_seqs,
        max_kv_bytes=engine.kv_budget(workers_on_node),
        onednn_linears=engine.onednn_linears,
        small_rows_kernel=engine.small_rows_kernel,
        decode_attention_kernel=engine.decode_attention_kernel,
        lean_forward=engine.lean_forward,
        max_model_len=engine.max_model_len,
    )


@dataclass
class _Branch:
    """One branch being grown: the node its next action extends (the expansion's, then each
    new node's), its seed and how many actions it has taken."""

    at: Expansion
    seed: int
    turn: int = 0

    def turn_seed(self) -> int:
        """The seed of the current turn's request: a function of the branch seed and the turn."""
        return (self.seed + self.turn * 0x9E3779B97F4A7C15) % 2**63


class RolloutWorker:
    """Expands agent-step trees for leased prompt groups with one engine (``workers_on_node``:
    rollout workers sharing this node's default KV budget, see ``make_engine``)."""

    def __init__(
        self,
        model_path: str,
        task: TaskConfig,
        tree: TreeConfig,
        sampling: SamplingConfig,
        engine: EngineConfig | None = None,
        seed: int = 0,
        torch_threads: int = 1,
        search: SearchFn | None = None,
        lora: bool = False,
        prompt_format: PromptFormat | None = None,
        workers_on_node: int = 1,
    ):
        torch.set_num_threads(torch_threads)
        self.engine = make_engine(model_path, engine or EngineConfig(), seed, lora, workers_on_node)
        self.tokenizer = load_tokenizer(model_path)
        self.env = make_env(task, search)
        self.shape = tree.shape()
        self.selection = tree.selection()
        self.sampling = sampling
        # one sequence of ids in, one string out (the stubs type decode for batches too)
        self.decode = cast(Decode, self.tokenizer.decode)
        self.stops = StopStrings(self.env.stop_sequences, self.decode)
        self.prompt_format = prompt_format or PromptFormat()

    @classmethod
    def from_config(
        cls,
        cfg: JobConfig,
        model_path: str,
        tree: TreeConfig | None = None,
        seed_offset: int = 0,
        search: SearchFn | None = None,
        workers_on_node: int = 1,
    ) -> RolloutWorker:
        """A worker with the job's task, tree (or ``tree``), sampling, engine and threads, seeded
        ``train.seed + seed_offset``."""
        return cls(
            model_path,
            cfg.task,
            tree or cfg.tree,
            cfg.sampling,
            cfg.engine,
            seed=cfg.train.seed + seed_offset,
            torch_threads=cfg.cluster.torch_threads,
            search=search,
            lora=cfg.engine.adapter_updates(cfg.model.lora.enabled),
            prompt_format=PromptFormat.of(cfg.model),
            workers_on_node=workers_on_node,
        )

    def policy_version(self) -> int:
        return self.engine.version

    def cache_stats(self) -> EngineCounters:
        """The engine's prefill / prefix-cache counters since start."""
        return self.engine.cache_stats()

    def load_weights(self, version: int, payload: dict[str, torch.Tensor] | LoraPayload) -> int:
        self.engine.load_weights(version, payload)
        return version

    def expand(self, lease: Lease) -> pa.Table:
        """Run the tree search for every group of the lease; returns the trees as Arrow, with the
        rollout's wall time and the part the planner's choices took (selection, allocation)."""
        start = time.perf_counter()
        rng = random.Random(lease.seed)
        trees = self._new_trees(lease.groups, self.shape.m)
        budgets = {group_id: Budget() for group_id, _ in lease.groups}
        planner = TreePlanner(self.shape, rng, self.selection)
        planner_seconds = 0.0
        self._complete(trees, planner.initial(trees), self.sampling.temperature, rng, budgets)
        for _ in range(planner.rounds()):
            chose = time.perf_counter()
            expansions = planner.next_round(trees)
            planner_seconds += time.perf_counter() - chose
            self._complete(trees, expansions, self.sampling.temperature, rng, budgets)
        planner.prune(trees)
        info = BatchInfo(
            lease.lease_id,
            self.engine.version,
            budgets,
            rollout_seconds=time.perf_counter() - start,
            planner_seconds=planner_seconds,
        )
        return trees_to_arrow(trees, info)

    def expand_leased(self, lease: Lease) -> tuple[LeaseReceipt, pa.Table]:
        """``expand`` plus a receipt the controller reads without fetching the trees."""
        table = self.expand(lease)
        receipt = LeaseReceipt(batch_info(table), self.cache_stats(), peak_rss_bytes())
        return receipt, table

    def evaluate(
        self, samples: list[Sample], temperature: float, seed: int, version: int
    ) -> list[float]:
        """One chain per sample (greedy when ``temperature`` is 0) by policy ``version``;
        returns 1.0/0.0 success each. Raises RuntimeError when this worker holds another
        version (a load of ``version`` sent before this call failed): a measurement is never
        of a policy other than the one it is recorded for."""
        if self.engine.version != version:
            raise RuntimeError(
                f"held-out evaluation of policy version {version}: this rollout worker holds "
                f"version {self.engine.version}, its load of version {version} failed (the "
                "weights' owner, the learner that published them, died or exited before this "
                "worker fetched them; the worker's log has the error)"
            )
        trees = self.evaluate_chains(samples, temperature, seed)
        return [float(self.env.success(tree.nodes[-1].env_state)) for tree in trees]

    def evaluate_chains(self, samples: list[Sample], temperature: float, seed: int) -> list[Tree]:
        """One chain (a one-leaf tree) per sample, greedy when ``temperature`` is 0.

        The evaluation leaves the prefix cache empty: a prefix's KV computed in its batches
        differs in float noise from the same prefix computed in a rollout's, enough to flip a
        draw now and then, so later trees would depend on whether and when evaluations ran (a
        resumed run would part from the uninterrupted one)."""
        rng = random.Random(seed)
        trees = self._new_trees(tuple(enumerate(samples)), copies=1)
        try:
            self._complete(trees, TreePlanner(self.shape, rng).initial(trees), temperature, rng, {})
        finally:
            self.engine.forget_prefixes()
        return trees

    def _new_trees(self, groups: tuple[tuple[int, Sample], ...], copies: int) -> list[Tree]:
        trees = []
        for group_id, sample in groups:
            prompt, state = self.env.reset(sample)
            prompt_ids = encode_prompt(self.tokenizer, prompt, self.prompt_format)
            for j in range(copies):
                tree_id = group_id * copies + j
                trees.append(Tree(tree_id, group_id, prompt_ids, root_state=state))
        return trees

    def _complete(
        self,
        trees: list[Tree],
        expansions: list[Expansion],
        temperature: float,
        rng: random.Random,
        budgets: dict[int, Budget],
    ) -> None:
        """Grow one branch per expansion until each ends in a leaf.

        Every branch is an episode of its own: its next turn goes to the engine as soon as its
        observation is back, so the engine's batch stays full across branches of any length
        (on an engine that only runs whole batches, ``WaveStepper``, the branches advance in
        waves). The actions that end in the same engine step go to the environment as one
        ``step_batch``. Each branch draws its seed from ``rng`` up front, in planner order, and
        its turns derive theirs from it, so the trees do not depend on the scheduling.
        """
        engine = stepped(self.engine)
        branches: dict[Hashable, _Branch] = {
            tag: _Branch(e, rng.getrandbits(63)) for tag, e in enumerate(expansions)
        }
        for tag, branch in branches.items():
            engine.submit(self._request(trees, branch, temperature), tag)
        while engine.pending():
            finished = engine.step()
            if not finished:
                continue
            stops = [(tag, r) for tag, r in finished if r.finish_reason == "stop"]
            states = [
                trees[branches[tag].at.tree_index].state_at(branches[tag].at.node_id)
                for tag, _ in stops
            ]
            steps = self.env.step_batch(states, [self.decode(r.token_ids) for _, r in stops])
            step_of = {tag: step for (tag, _), step in zip(stops, steps, strict=True)}
            for tag, result in finished:
                branch = branches[tag]
                tree = trees[branch.at.tree_index]
                node = self._add_node(tree, branch.at, result, step_of.get(tag))
                budgets.get(tree.group_id, Budget()).count_step(
                    len(result.token_ids),
                    result.prefill_tokens,
                    result.cached_tokens,
                    node.tool_call,
                    node.finished,
                )
                if node.finished:
                    del branches[tag]
                    continue
                branch.at, branch.turn = (
                    Expansion(branch.at.tree_index, node.node_id),
                    branch.turn + 1,
                )
                engine.submit(self._request(trees, branch, temperature), tag)

    def _request(self, trees: list[Tree], branch: _Branch, temperature: float) -> GenerationRequest:
        tree = trees[branch.at.tree_index]
        params = SamplingParams(
            temperature=temperature,
            top_p=self.sampling.top_p,
            max_new_tokens=self.sampling.max_action_tokens,
            seed=branch.turn_seed(),
        )
        return GenerationRequest(
            prefix_ids=tuple(tree.prefix_ids(branch.at.node_id)),
            params=params,
            stop=self.stops,
        )

    def _add_node(
        self, tree: Tree, expansion: Expansion, result: GenerationResult, step: StepResult | None
    ) -> AgentStep:
        """Attach the generated action (and the env's answer to it) as a child of the expanded
        node, with its mean token entropy and the planner's reason for branching there.

        An action that ended without a stop sequence (token or context limit) is a finished leaf
        whose reward is that of the episode with no answer.
        """
        parent_id = expansion.node_id
        entropies = result.entropies
        common = dict(
            action_ids=result.token_ids,
            action_logprobs=result.logprobs,
            policy_version=self.engine.version,
            cached_tokens=result.cached_tokens,
            entropy=sum(entropies) / len(entropies) if entropies else None,
            select_score=expansion.score,
            select_reason=expansion.reason,
        )
        if step is None:
            state = tree.state_at(parent_id)
            return tree.add(
                parent_id,
                obs_ids=[],
                finished=True,
                finish_reason=result.finish_reason,
                role="truncated",
                tool_call=False,
                reward=self.env.reward(state),
                env_state=state,
                **common,
            )
        obs_ids = self.tokenizer.encode(step.observation, add_special_tokens=False)
        return tree.add(
            parent_id,
            obs_ids=obs_ids,
            finished=step.done,
            finish_reason="done" if step.done else "stop",
            role=step.role,
            tool_call=step.tool_call,
            reward=self.env.reward(step.state) if step.done else float("nan"),
            env_state=step.state,
            **common,
        )
