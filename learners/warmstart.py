"""Supervised warm start of the tiny policy on noisy expert demonstrations of the multi-hop task.

RL from a policy that never succeeds learns nothing, so the CPU presets start from a policy
trained to imitate demonstrations of which a share (``noise``) contains a plausible mistake: it
then succeeds on some held-out questions when sampling and leaves room for RL to improve.
The result is cached on disk, keyed by a hash of every configuration that shapes it.

Calibration of the defaults (default task and tiny model, 2 CPU threads, 512 held-out questions,
seeds 0-3): ~110-120 s of training; held-out success 23-33% sampling at temperature 1.0 and
70-78% greedy. Fewer steps or a higher learning rate (3e-3, 5e-3) land lower and vary more
between seeds; 150 steps give well-formed actions but ~2% success.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from treegrpo_ray.atomic_dir import new_directory
from treegrpo_ray.config import TinyModelConfig, WarmStartConfig
from treegrpo_ray.envs.base import Sample
from treegrpo_ray.envs.multihop import MultihopConfig, MultihopEnv, MultihopTask
from treegrpo_ray.modeling import build_tiny_model, build_word_tokenizer

FORMAT_VERSION = 1  # bump when the training recipe changes, so old cache entries are not reused
LOG_NAME = "warmstart_log.json"


def cache_key(task_cfg: MultihopConfig, model_cfg: TinyModelConfig, ws_cfg: WarmStartConfig) -> str:
    """Hex digest of everything that shapes the warm-started policy (not where it is cached)."""
    payload = {
        "version": FORMAT_VERSION,
        "task": task_cfg.model_dump(),
        "model": model_cfg.model_dump(),
        "warmstart": ws_cfg.model_dump(exclude={"cache_dir"}),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def demonstration_tokens(
    env: MultihopEnv, vocab: dict[str, int], sample: Sample, rng: random.Random, noise: float
) -> tuple[list[int], list[bool]]:
    """Token ids of prompt + (action + observation)* for one demonstration, and the action mask.

    Returns ``(ids, action_mask)``, both of length T; ``action_mask[t]`` is True for tokens the
    policy generates (the loss is taken on those only).
    """
    prompt, state = env.reset(sample)
    ids = [vocab[w] for w in prompt.split()]
    mask = [False] * len(ids)
    for action in env.demonstration(sample, rng, noise):
        result = env.step(state, action)
        state = result.state
        action_ids = [vocab[w] for w in action.split()]
        obs_ids = [vocab[w] for w in result.observation.split()]
        ids += action_ids + obs_ids
        mask += [True] * len(action_ids) + [False] * len(obs_ids)
    return ids, mask


def collate(batch: list[tuple[list[int], list[bool]]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence: ``input_ids``, ``attention_mask``, ``labels``, all [B, T].

    ``labels`` are the input ids on action tokens and -100 elsewhere (padding included).
    """
    longest = max(len(ids) for ids, _ in batch)
    input_ids = torch.zeros(len(batch), longest, dtype=torch.long)
    attention_mask = torch.zeros(len(batch), longest, dtype=torch.long)
    labels = torch.full((len(batch), longest), -100, dtype=torch.long)
    for row, (ids, mask) in enumerate(batch):
        t = torch.tensor(ids)
        input_ids[row, : len(ids)] = t
        attention_mask[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(torch.tensor(mask), t, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def accumulate_gradients(
    model: torch.nn.Module, batch: list[tuple[list[int], list[bool]]]
) -> float:
    """Backpropagate the mean action-token cross-entropy of ``batch``; returns its value.

    The batch is sorted by length and run as two halves, so short demonstrations are not padded
    to the longest one; summing token losses over both halves keeps the result equal to one
    forward over the whole batch.
    """
    batch = sorted(batch, key=lambda item: len(item[0]))
    halves = [half for half in (batch[: len(batch) // 2], batch[len(batch) // 2 :]) if half]
    n_tokens = sum(sum(mask[1:]) for _, mask in batch)
    total = 0.0
    for half in halves:
        inputs = collate(half)
        logits = model(inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), inputs["labels"][:, 1:].flatten(), reduction="sum"
        ) / max(1, n_tokens)
        loss.backward()
        total += loss.item()
    return total


def lr_factor(step: int, steps: int) -> float:
    """Linear warmup over the first 5% of steps, then cosine decay to 10% of the peak."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _train(
    task: MultihopTask,
    model: torch.nn.Module,
    vocab: dict[str, int],
    ws_cfg: WarmStartConfig,
    progress: bool,
) -> list[float]:
    """Run ``ws_cfg.steps`` AdamW steps on fresh noisy demonstrations; returns the step losses."""
    env, samples, rng = MultihopEnv(task), task.train_samples(), random.Random(ws_cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ws_cfg.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, ws_cfg.steps))
    model.train()
    losses: list[float] = []
    bar = tqdm(range(ws_cfg.steps), desc="warm start", file=sys.stderr, disable=not progress)
    for _ in bar:
        batch = [
            demonstration_tokens(env, vocab, rng.choice(samples), rng, ws_cfg.noise)
            for _ in range(ws_cfg.batch_size)
        ]
        optimizer.zero_grad(set_to_none=True)
        loss = accumulate_gradients(model, batch)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    model.eval()
    return losses


def warm_start(
    task_cfg: MultihopConfig,
    model_cfg: TinyModelConfig,
    ws_cfg: WarmStartConfig,
    progress: bool = True,
) -> Path:
    """Train (or reuse) a warm-started tiny policy; returns its ``save_pretrained`` directory.

    The directory ``<cache_dir>/<hash of the three configs>`` holds model.safetensors, the
    tokenizer and ``warmstart_log.json`` (step losses, wall time, configs). It is written to a
    temporary directory and renamed, so a reader never sees a half-written policy.
    """
    root = Path(ws_cfg.cache_dir).expanduser()
    final = root / cache_key(task_cfg, model_cfg, ws_cfg)
    if (final / LOG_NAME).is_file():
        return final
    torch.set_num_threads(2)
    torch.manual_seed(ws_cfg.seed)
    started = time.perf_counter()
    task = MultihopTask(task_cfg)
    with new_directory(final, LOG_NAME) as tmp:
        tokenizer = build_word_tokenizer(task.vocabulary(), tmp)
        vocab = tokenizer.get_vocab()
        model = build_tiny_model(model_cfg, len(vocab), ws_cfg.seed)
        losses = _train(task, model, vocab, ws_cfg, progress)
        model.save_pretrained(str(tmp))
        log = {
            "losses": losses,
            "wall_s": time.perf_counter() - started,
            "task": task_cfg.model_dump(),
            "model": model_cfg.model_dump(),
            "warmstart": ws_cfg.model_dump(),
        }
        (tmp / LOG_NAME).write_text(json.dumps(log, indent=1))
    return final
