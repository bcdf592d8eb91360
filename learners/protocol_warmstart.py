"""Warm start of a pretrained instruct model on the search protocol (a LoRA pass, then merged).

A pretrained model that has never seen our action tags does not use them: zero-shot, SmolLM2-135M
wrote no ``<search>``/``<answer>`` pair in 16 samples, so every reward would be 0 and RL would have
no signal. This pass teaches the protocol, not the answers: on demonstrations built from the
fixture's train questions it learns to think, search for the entity the question names, read the
passages the real retriever returns, search again for a two-hop question, and answer from what it
read. ``warmstart.steps`` sets its strength: a few steps give a low-success start, which is the
interesting one for RL; 0 skips it. A share ``warmstart.noise`` of the demonstrations answers with
a wrong entity, so the policy does not learn to trust its first reading blindly.

The adapter is merged into the weights and the result saved as a model directory, cached by a hash
of everything that shapes it, with a report (``warmstart_log.json``): step losses, and the share of
format-valid actions and the held-out exact match before and after (sampled and greedy).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from treegrpo_ray.actors.retriever import Retriever
from treegrpo_ray.actors.rollout_worker import RolloutWorker
from treegrpo_ray.atomic_dir import new_directory
from treegrpo_ray.config import JobConfig, TreeConfig
from treegrpo_ray.envs.base import Sample
from treegrpo_ray.envs.search_qa import SearchQAEnv, SearchQATask
from treegrpo_ray.errors import UserInputError
from treegrpo_ray.learners.learner import with_lora_adapter
from treegrpo_ray.learners.warmstart import LOG_NAME, accumulate_gradients, lr_factor
from treegrpo_ray.metrics import format_valid_share
from treegrpo_ray.modeling import PromptFormat, encode_prompt, load_policy
from treegrpo_ray.tree import Tree

FORMAT_VERSION = 1  # bump when the recipe changes, so old cache entries are not reused


def cache_key(cfg: JobConfig, base: Path) -> str:
    """Hex digest of everything that shapes the warm-started policy."""
    payload = {
        "version": FORMAT_VERSION,
        "base": str(base),
        # how many held-out questions there are shapes only the log's evaluation, not the weights
        "task": cfg.task.search_qa.model_dump(exclude={"fixture_heldout", "heldout_questions"}),
        "prompt": [cfg.model.chat_template, cfg.model.system_prompt],
        "lora": cfg.model.lora.model_dump(),
        "warmstart": cfg.warmstart.model_dump(exclude={"cache_dir"}),
        "max_action_tokens": cfg.sampling.max_action_tokens,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def demonstration_actions(sample: Sample, titles: dict[str, str], wrong: str | None) -> list[str]:
    """The actions of one demonstration: a search per passage of ``meta['gold_ids']`` (by the
    passage's title, the entity it is about), then the answer (``wrong`` instead, if given)."""
    gold = dict(sample.meta).get("gold_ids")
    if not gold:
        raise UserInputError(
            f"sample {sample.uid} has no gold_ids: the protocol warm start builds demonstrations "
            "from the built-in fixture only; set task.search_qa.fixture=true or warmstart.steps=0"
        )
    names = [titles[doc_id] for doc_id in gold]
    actions = [f"<think> I need to find {names[0]}. </think>\n<search> {names[0]} </search>"]
    for found, nxt in zip(names, names[1:], strict=False):
        actions.append(
            f"<think> {found} leads to {nxt}. I need to find {nxt}. </think>\n<search> {nxt} </search>"
        )
    answer = wrong if wrong is not None else sample.answers[0]
    actions.append(f"<think> The answer is {answer}. </think>\n<answer> {answer} </answer>")
    return actions


class Demonstrations:
    """Token ids and action masks of demonstrations, observations from the real retriever."""

    def __init__(self, cfg: JobConfig, tokenizer: Any):
        self.cfg, self.tokenizer = cfg, tokenizer
        retriever = Retriever.from_config(cfg.task.search_qa)
        self.env = SearchQAEnv(cfg.task.search_qa, retriever.search_batch)
        self.titles = {p.id: p.title for p in retriever.passages}
        self.samples = SearchQATask(cfg.task.search_qa).train_samples()

    def draw(self, rng: random.Random) -> tuple[list[int], list[bool]]:
        """One demonstration: ``(ids, action_mask)``, both of length T (see warmstart.collate)."""
        sample = rng.choice(self.samples)
        wrong = None
        if rng.random() < self.cfg.warmstart.noise:
            wrong = rng.choice([t for t in self.titles.values() if t not in sample.answers])
        prompt, state = self.env.reset(sample)
        ids = encode_prompt(self.tokenizer, prompt, PromptFormat.of(self.cfg.model))
        mask = [False] * len(ids)
        for action in demonstration_actions(sample, self.titles, wrong):
            result = self.env.step(state, action)
            state = result.state
            action_ids = self.tokenizer.encode(action, add_special_tokens=False)
            obs_ids = self.tokenizer.encode(result.observation, add_special_tokens=False)
            ids += action_ids + obs_ids
            mask += [True] * len(action_ids) + [False] * len(obs_ids)
        return ids, mask


def protocol_report(trees: list[Tree], env: SearchQAEnv) -> dict[str, float]:
    """Share of actions with a valid tag pair, and exact match, over one chain per question."""
    success = [env.success(tree.leaves()[0].env_state) for tree in trees]
    return {
        "format_valid_actions": format_valid_share(trees),
        "exact_match": sum(success) / max(1, len(success)),
        "actions": float(sum(len(tree.nodes) for tree in trees)),
    }


def measure(cfg: JobConfig, policy: Path) -> dict[str, dict[str, float]]:
    """``protocol_report`` of ``policy`` on the held-out questions, sampled and greedy."""
    questions = SearchQATask(cfg.task.search_qa).heldout_samples()[: cfg.warmstart.eval_questions]
    if not questions:
        return {}
    worker = RolloutWorker(
        str(policy),
        cfg.task,
        TreeConfig(m=1, n=0, l=0),
        cfg.sampling,
        cfg.engine.model_copy(update={"kind": "hf"}),
        seed=cfg.warmstart.seed,
        torch_threads=cfg.cluster.torch_threads,
        prompt_format=PromptFormat.of(cfg.model),
    )
    env = worker.env
    assert isinstance(env, SearchQAEnv)
    return {
        name: protocol_report(worker.evaluate_chains(questions, temperature, cfg.train.seed), env)
        for name, temperature in (("sampled", cfg.sampling.temperature), ("greedy", 0.0))
    }


def _train(cfg: JobConfig, model: torch.nn.Module, tokenizer: Any, progress: bool) -> list[float]:
    """LoRA SFT for ``warmstart.steps`` steps; returns the step losses."""
    ws = cfg.warmstart
    demos, rng = Demonstrations(cfg, tokenizer), random.Random(ws.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=ws.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, ws.steps))
    model.train()
    losses: list[float] = []
    bar = tqdm(range(ws.steps), desc="protocol warm start", file=sys.stderr, disable=not progress)
    for _ in bar:
        batch = [demos.draw(rng) for _ in range(ws.batch_size)]
        optimizer.zero_grad(set_to_none=True)
        losses.append(accumulate_gradients(model, batch))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    model.eval()
    return losses


def protocol_warm_start(cfg: JobConfig, base: Path, progress: bool = True) -> Path:
    """Warm-start (or reuse) ``base`` on the search protocol; returns the merged model directory
    ``<warmstart.cache_dir>/<key>`` (written under a temporary name, then renamed)."""
    if cfg.task.name != "search_qa":
        raise UserInputError(
            f"model.pretrained warm-starts on the search_qa protocol, but task.name is "
            f"{cfg.task.name}; set task.name=search_qa (or model.path for another task)"
        )
    root = Path(cfg.warmstart.cache_dir).expanduser()
    final = root / f"{base.name}-{cache_key(cfg, base)}"
    if (final / LOG_NAME).is_file():
        return final
    torch.set_num_threads(cfg.cluster.torch_threads)
    torch.manual_seed(cfg.warmstart.seed)
    started = time.perf_counter()
    log: dict[str, Any] = {"before": measure(cfg, base)}
    with new_directory(final, LOG_NAME) as tmp:
        model, tokenizer = load_policy(base)
        adapted = with_lora_adapter(model, cfg.model.lora)
        log["losses"] = _train(cfg, adapted, tokenizer, progress)
        adapted.merge_and_unload().save_pretrained(str(tmp))  # type: ignore[operator]
        tokenizer.save_pretrained(str(tmp))
        log["after"] = measure(cfg, tmp)
        log["wall_s"] = time.perf_counter() - started
        log["warmstart"] = cfg.warmstart.model_dump()
        (tmp / LOG_NAME).write_text(json.dumps(log, indent=1))
        if progress:
            print(report_line(log), file=sys.stderr)
    return final


def report_line(log: dict[str, Any]) -> str:
    """One line: format-valid share of actions and held-out EM, before -> after."""
    parts = []
    for name in ("sampled", "greedy"):
        before, after = log["before"].get(name), log.get("after", {}).get(name)
        if before and after:
            parts.append(
                f"{name}: format-valid actions {before['format_valid_actions']:.0%} -> "
                f"{after['format_valid_actions']:.0%}, EM {before['exact_match']:.0%} -> "
                f"{after['exact_match']:.0%}"
            )
    return "protocol warm start: " + ("; ".join(parts) or "no held-out measurement")
