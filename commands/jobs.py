"""``treegrpo submit | status | logs | stop | scale``: training jobs on a Ray cluster, via the Ray Jobs API.

Address: ``--address``, else ``RAY_ADDRESS``, else ``http://127.0.0.1:8265`` (the head node's
dashboard; a bare ``HOST:PORT`` means http).

Token authentication (a cluster started with ``RAY_AUTH_MODE=token``): the token is looked up as
Ray looks it up - ``RAY_AUTH_TOKEN``, else the file named by ``RAY_AUTH_TOKEN_PATH``, else
``~/.ray/auth_token`` - and sent when ``RAY_AUTH_MODE=token``, when ``RAY_AUTH_TOKEN`` or
``RAY_AUTH_TOKEN_PATH`` is set, or to the default local address; never with
``RAY_AUTH_MODE=disabled``. (Ray's own client sends it only with ``RAY_AUTH_MODE=token``.)
A missing or rejected token, an unreachable address and an unknown job id are ``UserInputError``s.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import secrets
import shlex
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from treegrpo_ray.cluster.job_state import ScaleResult
from treegrpo_ray.errors import UserInputError

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
RUN_KEY = "treegrpo_run"  # job metadata: the run name; marks the jobs `treegrpo status` lists
# Never uploaded with the working directory (Ray also skips what .gitignore lists).
EXCLUDES = [
    ".git/",
    "runs/",
    "__pycache__/",
    "*.safetensors",
    "*.pt",
    ".venv/",
    ".mypy_cache/",
    ".ruff_cache/",
    ".pytest_cache/",
]
CONTROLLER_WAIT_S = 300  # `treegrpo scale` right after `submit`: the run's start-up time
JOB_COMMANDS = ("submit", "status", "logs", "stop", "scale")
_GET_TOKEN = "`ray get-auth-token` on the head node prints the cluster's token"


def resolve_address(address: str | None) -> str:
    """``address``, else ``RAY_ADDRESS``, else the local default; with a scheme, no trailing /."""
    address = address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS
    if "://" not in address:
        address = f"http://{address}"
    return address.rstrip("/")


def _token() -> tuple[str, str] | None:
    """(token, where it came from), in the order Ray's token loader reads the sources."""
    if value := os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return value, "RAY_AUTH_TOKEN"
    if path := os.environ.get("RAY_AUTH_TOKEN_PATH"):
        try:
            value = Path(path).expanduser().read_text().strip()
        except OSError:
            value = ""
        if not value:
            raise UserInputError(
                f"auth token missing: RAY_AUTH_TOKEN_PATH={path} is not a readable file holding "
                f"a token; point it at the cluster's token file ({_GET_TOKEN})"
            )
        return value, f"RAY_AUTH_TOKEN_PATH={path}"
    default = Path.home() / ".ray" / "auth_token"
    if default.is_file() and (value := default.read_text().strip()):
        return value, str(default)
    return None


def _auth(address: str) -> tuple[dict[str, str], str | None]:
    """(HTTP headers carrying the token, its source) - empty when no token is to be sent."""
    mode = os.environ.get("RAY_AUTH_MODE", "").lower()
    found = None if mode == "disabled" else _token()
    explicit = "RAY_AUTH_TOKEN" in os.environ or "RAY_AUTH_TOKEN_PATH" in os.environ
    if found and (mode == "token" or explicit or address == DEFAULT_ADDRESS):
        return {"Authorization": f"Bearer {found[0]}"}, found[1]
    if mode == "token":
        raise UserInputError(
            "auth token missing: RAY_AUTH_MODE=token but no token was found; set "
            f"RAY_AUTH_TOKEN=TOKEN or RAY_AUTH_TOKEN_PATH=FILE ({_GET_TOKEN})"
        )
    return {}, None


def _missing_token(address: str) -> UserInputError:
    hint = ""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        hint = " (RAY_AUTH_MODE=disabled here, so none is sent)"
    elif (Path.home() / ".ray" / "auth_token").is_file():
        hint = " (~/.ray/auth_token goes only to the default address or with RAY_AUTH_MODE=token)"
    return UserInputError(
        f"auth token missing: the Ray cluster at {address} requires a token and none was "
        f"sent{hint}; set RAY_AUTH_TOKEN=TOKEN or RAY_AUTH_TOKEN_PATH=FILE ({_GET_TOKEN})"
    )


def _rejected_token(address: str, source: str | None) -> UserInputError:
    return UserInputError(
        f"auth token rejected: the Ray cluster at {address} does not accept the token from "
        f"{source}; set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH to the cluster's token ({_GET_TOKEN})"
    )


def _unreachable(address: str, reason: object) -> UserInputError:
    return UserInputError(
        f"cannot reach the Ray dashboard at {address} ({reason}); pass --address "
        "http://HEAD:8265 or set RAY_ADDRESS (default http://127.0.0.1:8265)"
    )


@contextmanager
def _errors(address: str, source: str | None, job: str | None = None) -> Iterator[None]:
    """Turn the SDK's failures into one-line ``UserInputError``s; keep its INFO and WARNING
    logging (package uploads, socket closes) off the terminal."""
    import aiohttp
    import requests
    from ray.exceptions import AuthenticationError

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    except AuthenticationError as err:
        if str(err).startswith("Authentication failed"):  # HTTP 403: a token that is not theirs
            raise _rejected_token(address, source) from None
        raise _missing_token(address) from None
    except (ConnectionError, requests.RequestException, aiohttp.ClientConnectionError) as err:
        raise _unreachable(address, type(err).__name__) from None
    except RuntimeError as err:  # the SDK's "Request failed with status code N: BODY"
        if job is not None and "status code 404" in str(err):
            raise UserInputError(
                f"no job {job} on the Ray cluster at {address}; `treegrpo status --address "
                f"{address}` lists the treegrpo jobs"
            ) from None
        if not str(err).startswith("Request failed"):
            raise
        first_line = str(err).strip().splitlines()[0]
        raise UserInputError(f"the Ray cluster at {address} refused: {first_line}") from None
    finally:
        logging.disable(previous)


def _client(address: str | None) -> tuple[Any, str, str | None]:
    """(JobSubmissionClient, resolved address, token source) for ``address``."""
    from ray.job_submission import JobSubmissionClient

    address = resolve_address(address)
    headers, source = _auth(address)
    parts = urlsplit(address)
    try:  # a quick, bounded check first: the SDK's requests have no timeout
        port = parts.port or (443 if parts.scheme == "https" else 80)
        socket.create_connection((parts.hostname or "", port), timeout=10).close()
    except OSError as err:
        raise _unreachable(address, err.strerror or err) from None
    except ValueError as err:  # a malformed address, e.g. a port out of range
        raise _unreachable(address, err) from None
    # The SDK lets RAY_ADDRESS / RAY_API_SERVER_ADDRESS override the address it is given.
    saved = {
        k: os.environ.pop(k) for k in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS") if k in os.environ
    }
    try:
        with _errors(address, source):
            return JobSubmissionClient(address, headers=headers), address, source
    finally:
        os.environ.update(saved)


def _entrypoint_config(config: str, root: Path) -> str:
    """The CONFIG argument as the job sees it: a preset name, or a path relative to ``root``."""
    path = Path(config)
    if path.suffix not in (".yaml", ".yml") and not path.exists():
        return config  # a preset name (load_config has checked it)
    try:
        return path.resolve().relative_to(root).as_posix()
    except ValueError:
        raise UserInputError(
            f"config file {config} is outside the working directory {root}, which is all the "
            "cluster receives; move it under that directory or pass --working-dir DIR holding it"
        ) from None


def _requirements(path: str) -> list[str]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise UserInputError(f"cannot read requirements file {path}: {err.strerror}") from None
    return [s for line in lines if (s := line.split("#", 1)[0].strip())]


def submit(
    config: str,
    overrides: list[str] | None = None,
    address: str | None = None,
    working_dir: str | None = None,
    requirements: str | None = None,
    name: str | None = None,
) -> str:
    """Submit ``treegrpo train CONFIG --set ... --quiet`` as a Ray job; returns its id.

    The config is validated here first. ``working_dir`` (default: the current directory) is
    uploaded without ``EXCLUDES``; a config file must lie inside it. ``requirements``: a pip
    requirements file installed for the job. ``name`` sets the run name (``--set name=...``).
    The job joins the cluster it runs on (``cluster.address=auto``)."""
    from treegrpo_ray.config import load_config

    overrides = list(overrides or []) + ([f"name={name}"] if name else [])
    cfg = load_config(config, overrides)
    root = Path(working_dir or ".").resolve()
    if not root.is_dir():
        raise UserInputError(f"working directory {working_dir} is not a directory")
    args = ["python", "-m", "treegrpo_ray.commands.cli", "train", _entrypoint_config(config, root)]
    for override in [*overrides, "cluster.address=auto"]:
        args += ["--set", override]
    runtime_env: dict[str, Any] = {"working_dir": str(root), "excludes": EXCLUDES}
    if requirements:
        runtime_env["pip"] = _requirements(requirements)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", cfg.name).strip("-") or "run"
    job_id = f"treegrpo-{slug}-{secrets.token_hex(3)}"
    client, address, source = _client(address)
    with _errors(address, source):
        try:
            return client.submit_job(
                entrypoint=shlex.join([*args, "--quiet"]),
                submission_id=job_id,
                runtime_env=runtime_env,
                metadata={RUN_KEY: cfg.name},
            )
        except ValueError as err:  # e.g. a working dir over Ray's package size limit
            raise UserInputError(f"cannot submit: {' '.join(str(err).split())}") from None


def status(address: str | None, job: str | None = None) -> Any:
    """The ``JobDetails`` of ``job``; without one, those of all treegrpo jobs (oldest first)."""
    client, address, source = _client(address)
    with _errors(address, source, job):
        if job is not None:
            return client.get_job_info(job)
        jobs = [j for j in client.list_jobs() if RUN_KEY in (j.metadata or {})]
    return sorted(jobs, key=lambda j: j.start_time or 0)


def logs(address: str | None, job: str, follow: bool = False) -> None:
    """Print the job's output so far; with ``follow``, keep printing until the job ends."""
    client, address, source = _client(address)
    with _errors(address, source, job):
        client.get_job_info(job)  # an unknown id fails here, before any output
        if not follow:
            print(client.get_job_logs(job), end="", flush=True)
            return
        asyncio.run(_tail(client, job))


async def _tail(client: Any, job: str) -> None:
    async for chunk in client.tail_job_logs(job):
        print(chunk, end="", flush=True)


def stop(address: str | None, job: str) -> bool:
    """Ask the cluster to stop ``job``; True if it was still running."""
    client, address, source = _client(address)
    with _errors(address, source, job):
        client.get_job_info(job)
        return client.stop_job(job)


def scale(address: str | None, job: str, rollout_workers: int, timeout: float = 600) -> ScaleResult:
    """Resize the rollout pool of running job ``job`` (a job id or a run name) to
    ``rollout_workers``, through a short Ray job running ``treegrpo_ray.commands.scale`` on the cluster;
    returns the controller's answer (``Controller.scale``). The learners are not touched."""
    if rollout_workers < 1:
        raise UserInputError(
            f"--rollout-workers must be at least 1, got {rollout_workers}; `treegrpo stop JOB` "
            "ends a job"
        )
    client, address, source = _client(address)
    with _errors(address, source):
        run = _run_name(client, job)
        # A job submitted moments ago may not have started its controller yet: wait for it.
        wait = CONTROLLER_WAIT_S if _job_is_live(client, run) else 0
        command = [
            "python",
            "-m",
            "treegrpo_ray.commands.scale",
            run,
            str(rollout_workers),
            f"{wait:g}",
        ]
        scaler = client.submit_job(
            entrypoint=shlex.join(command),
            submission_id=f"treegrpo-scale-{secrets.token_hex(3)}",
        )
        deadline = time.monotonic() + timeout
        ended = False
        while not client.get_job_status(scaler).is_terminal():
            if time.monotonic() > deadline:
                raise UserInputError(f"scaling {run} took over {timeout:g} s; see {scaler}'s logs")
            if wait and not _job_is_live(client, run):  # it ended while the scaler waited
                ended = client.stop_job(scaler)
                break
            time.sleep(0.5)
        lines = client.get_job_logs(scaler).strip().splitlines() or ["(no output)"]
    if lines[-1].startswith("treegrpo: error: "):
        raise UserInputError(lines[-1].removeprefix("treegrpo: error: "))
    try:
        return ScaleResult.from_json(lines[-1])
    except ValueError:
        if ended:
            raise UserInputError(f"the job of run {run} ended before it could be scaled") from None
        raise UserInputError(f"scaling {run} failed: {lines[-1]}") from None


def _job_is_live(client: Any, run: str) -> bool:
    """Whether a treegrpo job of run ``run`` is pending or running."""
    return any(
        (j.metadata or {}).get(RUN_KEY) == run and not j.status.is_terminal()
        for j in client.list_jobs()
    )


def _run_name(client: Any, job: str) -> str:
    """The run name of job id ``job``; ``job`` itself when no job has that id."""
    try:
        info = client.get_job_info(job)
    except RuntimeError as err:
        if "status code 404" in str(err):
            return job
        raise
    return (info.metadata or {}).get(RUN_KEY, job)


def add_job_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``submit``, ``status``, ``logs`` and ``stop`` to the ``treegrpo`` parser."""
    address_help = f"Ray dashboard URL (default: $RAY_ADDRESS, else {DEFAULT_ADDRESS})"
    cmd = sub.add_parser("submit", help="run `treegrpo train` as a job on a Ray cluster")
    cmd.add_argument("config", help="a preset name or a YAML path inside the working directory")
    cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    cmd.add_argument("--name", help="run name (names the run directory and the job id)")
    cmd.add_argument("--working-dir", help="directory uploaded with the job (default: .)")
    cmd.add_argument("--requirements", metavar="FILE", help="pip requirements for the job")
    cmd.add_argument("--address", help=address_help)
    for name, help_text in (
        ("status", "a job's status, or all treegrpo jobs on the cluster"),
        ("logs", "a job's output"),
        ("stop", "stop a job"),
    ):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("job", nargs="?" if name == "status" else None, help="the job id")
        cmd.add_argument("--address", help=address_help)
    sub.choices["logs"].add_argument(
        "-f", "--follow", action="store_true", help="keep printing until the job ends"
    )
    cmd = sub.add_parser("scale", help="add or remove rollout workers of a running job")
    cmd.add_argument("job", help="the job id or the run name")
    cmd.add_argument("--rollout-workers", type=int, required=True, metavar="K")
    cmd.add_argument("--address", help=address_help)


def _when(timestamp_ms: int | None) -> str:
    if not timestamp_ms:
        return "-"
    return datetime.fromtimestamp(timestamp_ms / 1000).strftime("%Y-%m-%d %H:%M:%S")


def run_job_command(args: argparse.Namespace) -> int:
    """Run one of ``JOB_COMMANDS`` parsed by ``add_job_commands``; returns the exit code."""
    address = resolve_address(args.address)
    if args.command == "submit":
        job = submit(
            args.config, args.overrides, address, args.working_dir, args.requirements, args.name
        )
        print(f"submitted {job} to {address}")
        for command in (f"status {job}", f"logs {job} --follow", f"stop {job}"):
            print(f"  treegrpo {command} --address {address}")
    elif args.command == "status" and args.job is None:
        jobs = status(address)
        if not jobs:
            print(f"no treegrpo jobs on the Ray cluster at {address}")
        for j in jobs:
            print(
                f"{j.submission_id}  {j.status}  run={j.metadata[RUN_KEY]}  {_when(j.start_time)}"
            )
    elif args.command == "status":
        info = status(address, args.job)
        print(f"{args.job}: {info.status} - {info.message}")
    elif args.command == "logs":
        try:
            logs(address, args.job, args.follow)
        except KeyboardInterrupt:
            return 130
    elif args.command == "scale":
        result = scale(address, args.job, args.rollout_workers)
        added = result.added_versions
        print(
            f"{args.job}: {result.rollout_workers} rollout workers "
            f"(policy version {result.policy_version}"
            + (f"; {len(added)} added, on versions {added})" if added else ")")
        )
    else:
        running = stop(address, args.job)
        state = "stop requested" if running else "was not running"
        print(f"{args.job}: {state}; `treegrpo status {args.job} --address {address}` shows it")
    return 0
