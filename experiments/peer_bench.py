"""``treegrpo bench peer``: this project's rollout engine and learner beside TRL's ``GRPOTrainer``,
in one process on one machine: the same model files, LoRA, dtype, threads, prompts and sequences.

- **generation**: ``prompts`` prompts of the preset's task, ``group`` samples each, at most
  ``max_new_tokens`` new tokens, the preset's temperature, top-p 1, ending at the tokenizer's EOS
  (both engines). Twice: the first-turn prompts (``short``), and the same prompts followed by a
  search for the question and the passages it returns (``long``, Search-R1's second turn). TRL
  generates with its own code path (``GRPOTrainer._generate_single_turn``: the LoRA model's
  ``generate`` on a left-padded batch); ours with the preset's embedded engine (the adapter merged,
  the siblings' shared prompt served from the prefix cache). Generated tokens/s and the prefill
  tokens each one computed.
- **learner**: the sequences our engine generated on the long prompts, with the same rewards (a
  stand-in: a fixed function of the tokens, ``stand_in_reward``, so every group has distinct
  rewards and both gradients are non-zero), hence the same group-normalised advantages, from the same starting
  adapter: one optimizer step each (TRL: ``trainer.train`` with a ``rollout_func`` that returns the
  sequences, ``loss_type="bnpo"``, KL coefficient and learning rate of the preset; ours:
  ``Learner.update`` on one tree per prompt whose leaves are the group's sequences, so the prompt
  is forwarded once). Path tokens/s (prompt + completion of every sequence, what a flat learner
  trains), the reference pass's share, and both losses and gradient norms as a check that they
  did the same work.
- **update**: a whole update on the long prompts, generation + learner, each trainer's own.

Each measurement runs ``repeats`` times, TRL and ours alternating; the medians are reported with
the machine's roofline figures measured in the same run. TRL is the optional extra ``peer``
(``pip install -e '.[peer]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI imports this module to build its parser: torch etc. load lazily
    import torch

    from treegrpo_ray.config import JobConfig
    from treegrpo_ray.tree import Tree


@dataclass(frozen=True)
class PeerSettings:
    """What ``treegrpo bench peer`` compares (see the module docstring)."""

    preset: str = "smollm2-135m-search-qa"
    prompts: int = 4
    group: int = 6
    max_new_tokens: int = 48
    repeats: int = 2
    overrides: tuple[str, ...] = ()


@dataclass
class Generated:
    """One generation call: the completions (prompt-major, ``group`` per prompt) and its cost."""

    seconds: float
    completions: list[list[int]]
    prefill_tokens: int  # prompt tokens the engine computed (padding included for a padded batch)
    logprobs: list[list[float]] | None = None  # of each completion's tokens, where reported

    @property
    def tokens(self) -> int:
        return sum(len(c) for c in self.completions)


@dataclass
class Learned:
    """One optimizer step on the shared sequences."""

    seconds: float
    reference_seconds: float
    path_tokens: int
    loss: float
    grad_norm: float


@dataclass
class Workload:
    """The prompts both trainers get, as token ids (``short`` and ``long``)."""

    short: list[list[int]]
    long: list[list[int]]
    eos_text: str


@dataclass
class PeerReport:
    """Every run of every measurement (generation by prompt set, learner, whole update), by
    trainer (``trl``, ``ours``), with the versions and the machine's figures of the run."""

    settings: PeerSettings
    versions: dict[str, str]
    roofline: dict[str, float]
    generation: dict[str, dict[str, list[dict[str, float]]]] = field(default_factory=dict)
    learner: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    update: dict[str, list[float]] = field(default_factory=dict)


def stand_in_reward(completion: list[int]) -> float:
    """The shared reward, a fixed function of the tokens that differs between completions (so
    every group has advantages and both gradients are non-zero): the sum of the token ids modulo
    11, over 10."""
    return (sum(completion) % 11) / 10


def workload(cfg: JobConfig, tokenizer: Any, count: int) -> Workload:
    """The first-turn prompts of the task's first ``count`` training questions, and the same
    prompts followed by a search for the question and its observation (the env's own)."""
    from treegrpo_ray.actors.rollout_worker import make_env
    from treegrpo_ray.actors.schedule import load_task
    from treegrpo_ray.modeling import PromptFormat, encode_prompt

    env = make_env(cfg.task)
    fmt = PromptFormat(cfg.model.chat_template, cfg.model.system_prompt)
    short, long = [], []
    for sample in load_task(cfg.task).train_samples()[:count]:
        prompt, state = env.reset(sample)
        ids = encode_prompt(tokenizer, prompt, fmt)
        action = f"<search>{sample.question}</search>"
        step = env.step(state, action)
        turn = tokenizer.encode(action + step.observation, add_special_tokens=False)
        short.append(ids)
        long.append(ids + list(turn))
    return Workload(short, long, tokenizer.decode([tokenizer.eos_token_id]))


def our_generation(
    worker: Any,
    prompts: list[list[int]],
    s: PeerSettings,
    w: Workload,
    temperature: float,
    seed: int,
) -> Generated:
    """``s.group`` samples of each prompt from ``worker``'s engine, seeded per request."""
    from treegrpo_ray.engine import GenerationRequest, SamplingParams
    from treegrpo_ray.stops import StopStrings

    engine = worker.engine
    engine.cache.reset(engine.cache.version)  # nothing cached from an earlier call
    stop = StopStrings((w.eos_text,), worker.tokenizer.decode)
    requests = [
        GenerationRequest(
            tuple(p),
            SamplingParams(temperature, 1.0, s.max_new_tokens, seed=seed + i),
            stop,
        )
        for i, p in enumerate(p for p in prompts for _ in range(s.group))
    ]
    start = time.perf_counter()
    results = engine.generate(requests)
    seconds = time.perf_counter() - start
    computed = sum(r.prefill_tokens for r in results)  # the cached part not included
    completions = [r.token_ids for r in results]
    return Generated(seconds, completions, computed, [r.logprobs for r in results])


def trl_generation(trainer: Any, prompts: list[list[int]], s: PeerSettings) -> Generated:
    """``s.group`` samples of each prompt through TRL's generation path."""
    repeated = [p for p in prompts for _ in range(s.group)]
    start = time.perf_counter()
    completions, _ = trainer._generate_single_turn(repeated, None, {}, s.group)
    seconds = time.perf_counter() - start
    padded = len(repeated) * max(len(p) for p in repeated)
    return Generated(seconds, [list(c) for c in completions], padded)


def trees_of(prompts: list[list[int]], generated: Generated, s: PeerSettings) -> list[Tree]:
    """One tree per prompt whose leaves are its ``s.group`` completions (rewards: the stand-in)."""
    from treegrpo_ray.tree import ROOT, Tree

    trees = []
    assert generated.logprobs is not None
    for g, prompt in enumerate(prompts):
        tree = Tree(tree_id=g, group_id=g, prompt_ids=list(prompt))
        group = slice(g * s.group, (g + 1) * s.group)
        for c, logprobs in zip(
            generated.completions[group], generated.logprobs[group], strict=True
        ):
            tree.add(
                ROOT,
                action_ids=list(c),
                action_logprobs=list(logprobs),
                obs_ids=[],
                finished=True,
                finish_reason="stop",
                policy_version=0,
                role="answer",
                tool_call=False,
                reward=stand_in_reward(c),
            )
        trees.append(tree)
    return trees


def our_learner_step(learner: Any, trees: list[Tree]) -> Learned:
    """One ``Learner.update`` on ``trees`` (one optimizer step)."""
    start = time.perf_counter()
    metrics = learner.update(trees)
    seconds = time.perf_counter() - start
    return Learned(
        seconds,
        metrics["timing/ref_logprobs"],
        int(metrics["learner/path_tokens"]),
        metrics["learner/loss"],
        metrics["learner/grad_norm"],
    )


class _StepClock:
    """TRL callback: each optimizer step's wall time, and the time its no-grad log-prob passes
    (the reference) took."""

    def __init__(self, trainer: Any):
        import torch

        self.steps: list[float] = []
        self.reference: list[float] = []
        self._start = 0.0
        self._no_grad = 0.0
        forward = trainer._get_per_token_logps_and_entropies

        def timed_forward(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            out = forward(*args, **kwargs)
            if not torch.is_grad_enabled():
                self._no_grad += time.perf_counter() - begin
            return out

        trainer._get_per_token_logps_and_entropies = timed_forward

    def begin(self) -> None:
        self._start, self._no_grad = time.perf_counter(), 0.0

    def end(self) -> None:
        self.steps.append(time.perf_counter() - self._start)
        self.reference.append(self._no_grad)


def trl_trainer(
    cfg: JobConfig,
    model_path: str,
    s: PeerSettings,
    workdir: str,
    rollout: Callable[[list[str], Any], dict[str, Any]],
    reward: Callable[..., list[float | None]],
    dataset: list[str],
    steps_per_train: int = 1,
) -> Any:
    """A ``GRPOTrainer`` on the policy at ``model_path`` with the preset's LoRA, sampling, KL and
    learning rate, ``s.group`` generations per prompt and ``s.prompts`` prompts per step, whose
    rollouts and rewards are ``rollout`` and ``reward`` (TRL's ``rollout_func`` and reward
    function) on the prompts ``dataset``, taken in order. ``train()`` takes ``steps_per_train``
    optimizer steps."""
    import torch

    from treegrpo_ray.errors import UserInputError

    try:
        from datasets import Dataset
        from peft import LoraConfig
        from transformers import (
            AutoModelForCausalLM,
            PrinterCallback,
            ProgressCallback,
            TrainerCallback,
        )
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as error:
        raise UserInputError(
            f"treegrpo bench peer needs TRL ({error}); install the extra: pip install -e '.[peer]'"
        ) from error
    from treegrpo_ray.modeling import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    lora = cfg.model.lora
    args = GRPOConfig(
        output_dir=workdir,
        per_device_train_batch_size=s.prompts * s.group,
        num_generations=s.group,
        max_completion_length=s.max_new_tokens,
        temperature=cfg.sampling.temperature,
        top_p=1.0,
        beta=cfg.ppo.kl_coef,
        entropy_coef=cfg.ppo.entropy_coef,
        epsilon=cfg.ppo.clip_ratio,
        learning_rate=cfg.ppo.lr,
        loss_type="bnpo",
        scale_rewards="group",
        max_steps=10**6,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=cfg.train.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
        shuffle_dataset=False,
    )
    trainer: Any = GRPOTrainer(  # it carries the sequences and the clock (peer_*)
        model=AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": dataset}),
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft scales by alpha / r: a float works
            lora_dropout=0.0,
            target_modules=list(lora.target_modules),
            task_type="CAUSAL_LM",
        ),
        rollout_func=rollout,
    )
    clock = _StepClock(trainer)

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            clock.begin()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            clock.end()
            control.should_training_stop = state.global_step >= steps_per_train
            return control

    trainer.add_callback(Clock())
    for quiet in (PrinterCallback, ProgressCallback):  # the benchmark prints its own lines
        trainer.remove_callback(quiet)
    trainer.peer_clock = clock
    return trainer


def given_sequences(s: PeerSettings) -> Callable[[list[str], Any], dict[str, list]]:
    """TRL's ``rollout_func`` returning the sequences in ``trainer.peer_sequences`` (prompt ids
    and completions, prompt-major): the dataset's prompts are the indices of the prompt ids."""

    def rollout(prompts: list[str], trainer: Any) -> dict[str, list]:
        ids, generated = trainer.peer_sequences
        completions, logprobs = generated.completions, generated.logprobs
        seen: dict[int, int] = {}
        out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for g in (int(p) for p in prompts):
            k, seen[g] = seen.get(g, 0), seen.get(g, 0) + 1
            out["prompt_ids"].append(ids[g])
            out["completion_ids"].append(completions[g * s.group + k])
            out["logprobs"].append(logprobs[g * s.group + k])
        return out

    return rollout


def stand_in_rewards(completion_ids: list[list[int]], **_: Any) -> list[float | None]:
    return [stand_in_reward(c) for c in completion_ids]


def trl_learner_step(trainer: Any, prompts: list[list[int]], generated: Generated) -> Learned:
    """One optimizer step of TRL's trainer on the given sequences."""
    trainer.peer_sequences = (prompts, generated)
    trainer.train()  # a new TrainerState and optimizer each call
    logged = [e for e in trainer.state.log_history if "loss" in e][-1]
    clock = trainer.peer_clock
    group = len(generated.completions) // len(prompts)
    paths = sum(len(prompts[i // group]) + len(c) for i, c in enumerate(generated.completions))
    return Learned(clock.steps[-1], clock.reference[-1], paths, logged["loss"], logged["grad_norm"])


def copy_adapter(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Give ``target`` (a peft model) the LoRA weights of ``source``: the same starting adapter."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    set_peft_model_state_dict(target, get_peft_model_state_dict(source))


def run_peer(
    s: PeerSettings, out: Path | None = None, progress: Callable[[str], None] = print
) -> PeerReport:
    """Every measurement of the module docstring; written to ``out`` (JSON and a table)."""
    import torch

    from treegrpo_ray.actors.rollout_worker import RolloutWorker
    from treegrpo_ray.config import load_config
    from treegrpo_ray.learners.learner import Learner
    from treegrpo_ray.learners.policies import resolve_model_path

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    sets = [*s.overrides, "ppo.advantage=chain", "ppo.epochs=1", "ppo.minibatches=1"]
    cfg = load_config(s.preset, sets)
    torch.set_num_threads(cfg.cluster.torch_threads)
    path = str(resolve_model_path(cfg))  # a first run prepares the model: show its progress
    worker = RolloutWorker.from_config(cfg, path)
    w = workload(cfg, worker.tokenizer, s.prompts)
    report = PeerReport(s, versions(), roofline())
    with tempfile.TemporaryDirectory() as workdir:
        indices = [str(i) for i in range(s.prompts)]
        trainer = trl_trainer(cfg, path, s, workdir, given_sequences(s), stand_in_rewards, indices)
        for name, prompts in (("short", w.short), ("long", w.long)):
            report.generation[name] = _generations(trainer, worker, prompts, s, w, cfg, progress)
        shared = our_generation(worker, w.long, s, w, cfg.sampling.temperature, seed=7)
        report.learner = {"trl": [], "ours": []}
        for r in range(s.repeats):
            learner = Learner.from_config(cfg, path)
            copy_adapter(learner.model, trainer.model)
            steps = {
                "trl": trl_learner_step(trainer, w.long, shared),
                "ours": our_learner_step(learner, trees_of(w.long, shared, s)),
            }
            for key, step in steps.items():
                report.learner[key].append(asdict(step))
            progress(f"learner {r + 1}/{s.repeats}: " + _pair(report.learner))
        report.update = {
            key: [
                g["seconds"] + step["seconds"]
                for g, step in zip(report.generation["long"][key], report.learner[key], strict=True)
            ]
            for key in ("trl", "ours")
        }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(asdict(report), indent=2))
        (out / "table.md").write_text(table(report) + "\n")
    return report


def _generations(
    trainer: Any,
    worker: Any,
    prompts: list[list[int]],
    s: PeerSettings,
    w: Workload,
    cfg: JobConfig,
    progress: Callable[[str], None],
) -> dict[str, list[dict[str, float]]]:
    """``s.repeats`` generations of ``prompts`` by TRL and by ours, alternating."""
    runs: dict[str, list[dict[str, float]]] = {"trl": [], "ours": []}
    for r in range(s.repeats):
        runs["trl"].append(_generation_row(trl_generation(trainer, prompts, s)))
        ours = our_generation(worker, prompts, s, w, cfg.sampling.temperature, seed=1000 * r)
        runs["ours"].append(_generation_row(ours))
        progress(f"generation ({len(prompts[0])}-token prompt) {r + 1}/{s.repeats}: " + _pair(runs))
    return runs


def _pair(runs: dict[str, list[dict[str, float]]]) -> str:
    return ", ".join(
        f"{key} " + " ".join(f"{k}={v:.4g}" for k, v in rows[-1].items())
        for key, rows in runs.items()
    )


def _generation_row(g: Generated) -> dict[str, float]:
    return {
        "seconds": g.seconds,
        "tokens": g.tokens,
        "tokens_per_s": g.tokens / g.seconds,
        "prefill_tokens": g.prefill_tokens,
    }


def versions() -> dict[str, str]:
    import peft
    import torch
    import transformers

    found = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "python": platform.python_version(),
    }
    try:
        import trl

        found["trl"] = trl.__version__
    except ImportError:
        pass
    return found


def roofline() -> dict[str, float]:
    """The machine's copy bandwidth (GB/s) and float32 matmul rate (GFLOP/s), measured now."""
    import torch

    x = torch.empty(64 * 2**20 // 4)
    y = torch.empty_like(x)
    copies = []
    for _ in range(5):
        start = time.perf_counter()
        y.copy_(x)
        copies.append(time.perf_counter() - start)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    matmuls = []
    for _ in range(5):
        start = time.perf_counter()
        torch.mm(a, b)
        matmuls.append(time.perf_counter() - start)
    return {
        "copy_gb_per_s": 2 * x.nbytes / min(copies) / 1e9,
        "matmul_gflop_per_s": 2 * 1024**3 / min(matmuls) / 1e9,
        "threads": float(torch.get_num_threads()),
    }


def median_of(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def table(report: PeerReport) -> str:
    """The report's medians as a Markdown table, ours / TRL as the last column."""
    lines = ["| measurement | TRL | ours | ours / TRL |", "|---|---|---|---|"]
    for name, runs in report.generation.items():
        trl, ours = (median_of(runs[k], "tokens_per_s") for k in ("trl", "ours"))
        lines.append(
            f"| generation, {name} prompts, tokens/s | {trl:.1f} | {ours:.1f} | {ours / trl:.2f}x |"
        )
        trl_p, ours_p = (median_of(runs[k], "prefill_tokens") for k in ("trl", "ours"))
        lines.append(
            f"| generation, {name} prompts, prefill tokens computed | {trl_p:.0f} | "
            f"{ours_p:.0f} | {ours_p / trl_p:.2f}x |"
        )
    trl_l, ours_l = report.learner["trl"], report.learner["ours"]
    paths = trl_l[0]["path_tokens"]
    trl_s, ours_s = median_of(trl_l, "seconds"), median_of(ours_l, "seconds")
    lines.append(
        f"| learner step, seconds | {trl_s:.2f} | {ours_s:.2f} | {trl_s / ours_s:.2f}x faster |"
    )
    lines.append(
        f"| learner, path tokens/s ({paths} path tokens) | {paths / trl_s:.0f} | "
        f"{paths / ours_s:.0f} | {trl_s / ours_s:.2f}x |"
    )
    trl_r, ours_r = median_of(trl_l, "reference_seconds"), median_of(ours_l, "reference_seconds")
    lines.append(
        f"| reference pass, seconds | {trl_r:.2f} | {ours_r:.2f} | "
        f"{trl_r / max(ours_r, 1e-9):.2f}x faster |"
    )
    for key in ("loss", "grad_norm"):
        lines.append(f"| first step's {key} | {trl_l[0][key]:.4g} | {ours_l[0][key]:.4g} | |")
    trl_u, ours_u = (statistics.median(report.update[k]) for k in ("trl", "ours"))
    lines.append(
        f"| whole update (long prompts), seconds | {trl_u:.2f} | {ours_u:.2f} | "
        f"{trl_u / ours_u:.2f}x faster |"
    )
    roof = report.roofline
    lines.append(
        f"\nMachine in the same run: copy {roof['copy_gb_per_s']:.1f} GB/s, float32 matmul "
        f"{roof['matmul_gflop_per_s']:.0f} GFLOP/s, {roof['threads']:.0f} threads; "
        + ", ".join(f"{k} {v}" for k, v in report.versions.items())
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = PeerSettings()
    parser.add_argument("--preset", default=defaults.preset)
    parser.add_argument("--prompts", type=int, default=defaults.prompts)
    parser.add_argument("--group", type=int, default=defaults.group, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field of the preset",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/peer_trl"))


def run_from_args(args: argparse.Namespace) -> int:
    settings = PeerSettings(
        args.preset,
        args.prompts,
        args.group,
        args.max_new_tokens,
        args.repeats,
        tuple(args.overrides),
    )
    report = run_peer(settings, args.out)
    print(table(report))
    return 0
