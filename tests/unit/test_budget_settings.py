"""The SmolLM2 budget suite is what the README pre-registers (issue 28): a change to its
settings must show up here, not slip into a rerun."""

from collections import Counter

from treegrpo_ray.experiments.budget_suite import SMOLLM2, SUITES, eval_steps, jobs

PRESET = "smollm2-135m-search-qa"


def test_the_smollm2_suite_is_what_the_readme_pre_registers():
    assert SUITES[PRESET] is SMOLLM2
    suite = jobs(PRESET, SMOLLM2)
    arms = Counter(job.arm for job in suite)
    assert arms == {"tree-1x2x1": 6, "chain-2": 6, "chain-3": 3, "chain-4": 3, "tree-2x2x1": 3}
    assert {job.start for job in suite} == {"low"}
    assert eval_steps(SMOLLM2) == [6, 8]  # greedy at 75% and at the end
    assert (SMOLLM2.eval_questions, SMOLLM2.eval_samples, SMOLLM2.sampled_along) == (200, 1, False)
    cfg = suite[0].config()
    assert (cfg.train.steps, cfg.train.prompts_per_step, cfg.train.max_policy_lag) == (8, 4, 0)
    assert cfg.warmstart.steps == 10  # the preset's protocol warm start: the "low" start
    assert cfg.task.search_qa.heldout_questions == 200
    assert (cfg.cluster.torch_threads, cfg.train.save_trees_every) == (1, 1)
