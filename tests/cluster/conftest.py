"""A real two-node Ray cluster on this machine, with token authentication on.

``start_cluster(root)`` is a context manager (for tests that kill or add nodes); ``ray_cluster``
is the one a test module shares. Head: 1 CPU + ``{"learner_node": 1}``, dashboard on 127.0.0.1;
second node: 1 CPU + ``{"rollout_node": 1}``. Each node is a ``ray start --block`` child of the test
process with its own temp dir and free ports; stopping it stops that node's Ray processes and
nothing else on the machine (``ray stop`` would stop every Ray process here).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import requests

from treegrpo_ray.cluster.local_ray import WORKER_NICENESS_ENV

NODE_RESOURCES = ({"learner_node": 1}, {"rollout_node": 1})  # head, second node
# GPUs each node declares without having them (Ray accounts them; nothing here asks for CUDA):
# what placement tests need of a GPU cluster
FAKE_GPUS_PER_NODE = 2
START_TIMEOUT_S = 180


@dataclass
class RayTestCluster:
    """What a test needs to reach the cluster."""

    gcs_address: str  # NODE_IP:PORT, for ray.init(address=...) / ray start --address
    dashboard_url: str  # http://127.0.0.1:PORT, for the Jobs API and `treegrpo --address`
    token: str
    token_path: Path
    node_ids: dict[str, str]  # custom resource -> id of the node that has it
    root: Path  # temp dirs and node logs (ROOT/head.log, ROOT/node1.log)
    processes: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def client_env(self) -> dict[str, str]:
        """Environment variables a client of this cluster needs (Ray's way: mode + token)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


# `ray start --block` prints this once the node registered with the GCS and the head's dashboard
# serves HTTP: the node is ready (its "Local node IP" line came before).
READY_LINE = "This command will now block forever"


def _ray_start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start one node; return once it printed READY_LINE (its output goes on to ``log``)."""
    agent, agent_grpc, runtime_env, metrics, manager, objects, client = _free_ports(7)
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", *args]
    command += ["--num-cpus", "1"]
    command += ["--object-store-memory", str(200 * 2**20), "--disable-usage-stats"]
    command += ["--dashboard-agent-listen-port", str(agent)]
    command += ["--dashboard-agent-grpc-port", str(agent_grpc)]
    command += ["--runtime-env-agent-port", str(runtime_env), "--metrics-export-port", str(metrics)]
    command += ["--node-manager-port", str(manager), "--object-manager-port", str(objects)]
    command += ["--ray-client-server-port", str(client)]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    ready = threading.Event()

    def copy_output() -> None:  # sets `ready` at EOF too, so a node that exits never hangs us
        with log.open("w") as out:
            for line in process.stdout:
                out.write(line)
                out.flush()
                if READY_LINE in line:
                    ready.set()
        ready.set()

    threading.Thread(target=copy_output, daemon=True).start()
    if not ready.wait(START_TIMEOUT_S) or process.poll() is not None:
        process.kill()
        raise RuntimeError(f"`ray start {args[0]}` did not come up; its output:\n{log.read_text()}")
    return process


def _head_address(log: Path, gcs_port: int) -> str:
    """NODE_IP:PORT of the head's GCS, from the "Local node IP" line `ray start` prints before its
    ready line (its ray_current_cluster file was seen missing at that point once)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text())  # the CLI's colours
    found = re.search(r"Local node IP: ?([0-9A-Fa-f.:]+)", text)
    if found is None:
        raise RuntimeError(f"the head printed no node IP; its output:\n{text}")
    return f"{found.group(1)}:{gcs_port}"


def _alive_nodes(url: str, headers: dict[str, str]) -> list[dict]:
    r = requests.get(f"{url}/api/v0/nodes", params={"detail": "1"}, headers=headers, timeout=10)
    r.raise_for_status()
    return [n for n in r.json()["data"]["result"]["result"] if n["state"] == "ALIVE"]


def _stop(processes: list[subprocess.Popen], root: Path) -> None:
    """SIGTERM each node (the last started first), then kill whatever still runs under ``root``."""
    for p in reversed(processes):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    # A safety net for processes that outlived their node: a job's driver runs in a working
    # dir under ROOT, the node's own processes name ROOT on their command line.
    marker = f"{root}/"
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        with contextlib.suppress(psutil.Error):
            if marker in " ".join(proc.info["cmdline"] or []) or (
                proc.info["cwd"] or ""
            ).startswith(marker):
                proc.kill()


@contextlib.contextmanager
def start_cluster(
    root: Path | None = None, extra_env: dict[str, str] | None = None
) -> Iterator[RayTestCluster]:
    """Start the two nodes (token auth on), yield the cluster, stop both nodes.

    ``root``: a short directory (Ray's socket paths must stay under ~100 characters); by
    default a new one under /tmp, removed afterwards."""
    owned = root is None
    root = Path(tempfile.mkdtemp(prefix="tgc-", dir="/tmp")) if root is None else root
    token = secrets.token_hex(32)
    token_path = root / "auth_token"
    token_path.write_text(token)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token_path),
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
        **WORKER_NICENESS_ENV,  # as `treegrpo train` starts Ray: tests share the machine
        **(extra_env or {}),
    )
    gcs_port, dashboard_port = _free_ports(2)
    url = f"http://127.0.0.1:{dashboard_port}"
    headers = {"Authorization": f"Bearer {token}"}
    processes: list[subprocess.Popen] = []
    try:
        head = ["--head", "--port", str(gcs_port), "--temp-dir", str(root / "head")]
        head += ["--include-dashboard", "true", "--dashboard-host", "127.0.0.1"]
        head += ["--dashboard-port", str(dashboard_port)]
        head += ["--resources", json.dumps(NODE_RESOURCES[0])]
        head += ["--num-gpus", str(FAKE_GPUS_PER_NODE)]
        processes.append(_ray_start(head, env, root / "head.log"))
        gcs_address = _head_address(root / "head.log", gcs_port)
        node = ["--address", gcs_address, "--temp-dir", str(root / "node1")]
        node += ["--resources", json.dumps(NODE_RESOURCES[1])]
        node += ["--num-gpus", str(FAKE_GPUS_PER_NODE)]
        processes.append(_ray_start(node, env, root / "node1.log"))
        names = [name for resources in NODE_RESOURCES for name in resources]
        nodes = _alive_nodes(url, headers)
        ids = {r: n["node_id"] for n in nodes for r in n["resources_total"] if r in names}
        assert len(ids) == len(names), f"nodes with {names} not all alive: {nodes}"
        yield RayTestCluster(gcs_address, url, token, token_path, ids, root, processes)
    finally:
        _stop(processes, root)
        if owned:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayTestCluster]:
    """The two-node token-auth cluster, shared by the tests of a module (do not kill nodes);
    stopped after them, so that its idle processes do not slow the tests that follow."""
    with start_cluster() as cluster:
        yield cluster
