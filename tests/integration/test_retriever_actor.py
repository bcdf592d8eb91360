"""The retriever as a named Ray actor on a real local Ray: concurrent batched clients get exactly
what the in-process retriever returns, and the environment searches through the client."""

import pytest
import ray

from treegrpo_ray.actors.retriever import Retriever
from treegrpo_ray.actors.rollout_worker import make_env
from treegrpo_ray.cluster.retriever import RetrieverClient, retriever_actor_name, start_retriever
from treegrpo_ray.config import TaskConfig
from treegrpo_ray.envs.qa_fixture import build_fixture
from treegrpo_ray.envs.search_qa import SearchQAConfig

pytestmark = pytest.mark.ray

CFG = SearchQAConfig(fixture=True)
NAME = retriever_actor_name("test-retriever")


@pytest.fixture(scope="module")
def client(local_ray):
    retriever = start_retriever(CFG, NAME, num_cpus=0)
    try:
        assert retriever.ready() == 200  # waits for the actor to build its index
        yield retriever
    finally:
        ray.kill(retriever.handle)


@ray.remote(num_cpus=0)  # the tasks and the actor share whatever CPUs the cluster has
def search_from_a_task(client: RetrieverClient, queries: list[str]) -> list:
    return client(queries, 3)


def test_concurrent_batched_calls_equal_the_in_process_retriever(client):
    fixture = build_fixture(0)
    local = Retriever.from_config(CFG)
    batches = [[s.question for s in fixture.train[:40]], [s.question for s in fixture.train[40:]]]
    # Two tasks in other worker processes call the actor at the same time through pickled clients.
    refs = [search_from_a_task.remote(client, batch) for batch in batches]
    remote = ray.get(refs)
    assert remote == [local.search_batch(batch, 3) for batch in batches]
    assert [len(r) for r in remote] == [40, 40]
    assert client([], 3) == []


def test_the_named_actor_is_shared_and_serves_the_environment(client):
    again = start_retriever(CFG, NAME)  # joins the running actor instead of starting another
    assert again.handle._actor_id == client.handle._actor_id
    assert ray.get_actor(NAME)._actor_id == client.handle._actor_id

    task = TaskConfig(name="search_qa", search_qa=CFG)
    through_actor, in_process = make_env(task, search=again), make_env(task)
    samples = build_fixture(0).test[:3]
    states = [through_actor.reset(s)[1] for s in samples]
    actions = [f"<search> {s.question} </search>" for s in samples]
    assert through_actor.step_batch(states, actions) == in_process.step_batch(states, actions)
