"""A Hub id reaches a rollout worker (a Ray actor) as written and resolves in that worker's own
Hugging Face cache (``HF_HUB_CACHE`` of its node, here set through the actor's runtime_env): the
driver, whose cache does not hold it, never resolves it."""

import pytest
import ray
from ray.exceptions import RayActorError

from treegrpo_ray.actors.rollout_worker import RolloutWorker
from treegrpo_ray.actors.schedule import Lease
from treegrpo_ray.config import TreeConfig
from treegrpo_ray.envs.multihop import MultihopTask

pytestmark = pytest.mark.ray

TREE = TreeConfig(m=2, n=1, l=1)


def _worker_on_a_node_with(cache, model_path, cfg):
    """A rollout worker whose process sees ``cache`` as its node's (offline) Hugging Face cache."""
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return (
        ray.remote(RolloutWorker)
        .options(num_cpus=0, runtime_env={"env_vars": env})
        .remote(model_path, cfg.task, TREE, cfg.sampling, seed=0)
    )


def test_a_worker_resolves_the_hub_id_in_its_node_cache(local_ray, hub_policy, tiny_cfg):
    samples = MultihopTask(tiny_cfg.task.multihop).train_samples()[:2]
    lease = Lease(lease_id=0, groups=tuple(enumerate(samples)), seed=3)
    worker = _worker_on_a_node_with(hub_policy.cache, hub_policy.repo_id, tiny_cfg)
    remote = ray.get(worker.expand.remote(lease))
    # The same lease in this process, from the snapshot directory: the same model, so the same
    # trees, token for token.
    local = RolloutWorker(hub_policy.snapshot, tiny_cfg.task, TREE, tiny_cfg.sampling, seed=0)
    assert remote.equals(local.expand(lease))
    assert remote.num_rows > 0


def test_a_worker_whose_node_lacks_the_id_names_its_cache(
    local_ray, hub_policy, tiny_cfg, tmp_path
):
    worker = _worker_on_a_node_with(tmp_path / "empty", hub_policy.repo_id, tiny_cfg)
    with pytest.raises(RayActorError) as err:
        ray.get(worker.policy_version.remote())
    message = str(err.value)
    assert (
        f"model.path: {hub_policy.repo_id} has no complete snapshot in the Hugging Face cache of "
        f"node" in message
    )
    assert f"({tmp_path / 'empty'}) and HF_HUB_OFFLINE is set" in message
    assert f"hf download {hub_policy.repo_id}" in message
