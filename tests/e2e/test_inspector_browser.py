"""The tree inspector's page in a real browser (Debian's headless Chromium through Selenium): what
a person sees matches the saved trees.

The trees are a real step of the tiny preset (32 prompts, (M, N, L) = (2, 2, 1)) expanded by the
tiny policy and updated by the learner, saved as step 1, and a second update on 4 of its prompts,
saved as step 2.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from treegrpo_ray.actors.rollout_worker import RolloutWorker
from treegrpo_ray.actors.schedule import Lease
from treegrpo_ray.commands.cli import main
from treegrpo_ray.envs.multihop import MultihopTask
from treegrpo_ray.learners.learner import Learner
from treegrpo_ray.packing import pack_trees
from treegrpo_ray.saved_trees import (
    node_advantages,
    read_saved_trees,
    saved_trees_table,
    write_saved_trees,
)
from treegrpo_ray.tree import ROOT, Tree, trees_from_arrow

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# The network is closed here: nothing may try to reach it, and no state is shared between runs.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,900",
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="needs Debian's chromium: bash scripts/install-browser.sh"
    ),
]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def run_dir(tiny_cfg, tiny_policy, tmp_path_factory):
    """A run directory with two saved steps of real trees (see the module docstring)."""
    run = tmp_path_factory.mktemp("inspected-run")
    worker = RolloutWorker(tiny_policy, tiny_cfg.task, tiny_cfg.tree, tiny_cfg.sampling, seed=0)
    prompts = tiny_cfg.train.prompts_per_step
    samples = MultihopTask(tiny_cfg.task.multihop).train_samples()[:prompts]
    trees = trees_from_arrow(worker.expand(Lease(0, tuple(enumerate(samples)), seed=5)))
    learner = Learner(tiny_policy, tiny_cfg.ppo, temperature=1.0)
    learner.save_trees(run, trees, learner.update(trees))
    few = [t for t in trees if t.group_id < 4]
    learner.save_trees(run, few, learner.update(few))
    return run


def _open(browser, run_dir: Path, *args: str) -> Path:
    page = run_dir / "page.html"
    assert main(["trees", str(run_dir), "--out", str(page), *args]) == 0
    browser.get(page.as_uri())
    return page


def _shown_nodes(browser) -> list[tuple[int, int, str, str, bool]]:
    """Every rendered node: (tree, node, advantage text, background colour, displayed)."""
    rows = browser.execute_script(
        """return [...document.querySelectorAll("li.node")].map((li) => {
             const adv = li.querySelector(":scope > .row .adv");
             return [Number(li.dataset.tree), Number(li.dataset.node),
                     adv.querySelector(".adv-value").textContent,
                     getComputedStyle(adv).backgroundColor, li.checkVisibility()];
           });"""
    )
    return [tuple(row) for row in rows]


def test_every_node_is_rendered_with_its_saved_advantage(browser, run_dir):
    _open(browser, run_dir, "--step", "1")
    table, _ = read_saved_trees(run_dir, 1)
    saved = {(r["tree_id"], r["node_id"]): r for r in table.to_pylist()}
    shown = _shown_nodes(browser)

    assert len(shown) == table.num_rows == len(saved)  # 32 prompts x 2 trees, every node
    assert {(tree, node) for tree, node, *_ in shown} == set(saved)
    for tree, node, text, colour, displayed in shown:
        row = saved[(tree, node)]
        value = row["advantage"] if row["finished"] else row["routed_advantage"]
        assert float(text) == pytest.approx(value, abs=5e-4), (tree, node)
        assert displayed
        if round(value, 3) > 0:
            assert colour.startswith("rgba(31, 136, 61"), (tree, node, colour)  # green
        elif round(value, 3) < 0:
            assert colour.startswith("rgba(207, 34, 46"), (tree, node, colour)  # red


def test_expanding_a_node_reveals_its_children(browser, run_dir):
    _open(browser, run_dir, "--step", "1")
    table, _ = read_saved_trees(run_dir, 1)
    rows = table.to_pylist()
    browser.find_element(By.ID, "collapse-all").click()
    visible = {(t, n) for t, n, *_, displayed in _shown_nodes(browser) if displayed}
    assert visible == {(r["tree_id"], r["node_id"]) for r in rows if r["parent_id"] == ROOT}

    tree, node = next((r["tree_id"], r["node_id"]) for r in rows if not r["finished"])
    children = {
        (tree, r["node_id"]) for r in rows if (r["tree_id"], r["parent_id"]) == (tree, node)
    }
    item = browser.find_element(By.CSS_SELECTOR, f'li.node[data-tree="{tree}"][data-node="{node}"]')
    item.find_element(By.CSS_SELECTOR, ":scope > .row > .toggle").click()
    now = {(t, n) for t, n, *_, displayed in _shown_nodes(browser) if displayed}
    assert now == visible | children  # the children, and not their own collapsed children


def test_hovering_shows_a_nodes_details_and_the_step_selector_switches_steps(browser, run_dir):
    _open(browser, run_dir)  # the last saved step first
    select = Select(browser.find_element(By.ID, "step"))
    assert [o.text for o in select.options] == ["step 1", "step 2"]
    step2, _ = read_saved_trees(run_dir, 2)
    assert select.first_selected_option.text == "step 2"
    assert len(browser.find_elements(By.CSS_SELECTOR, "li.node")) == step2.num_rows

    leaf = next(r for r in step2.to_pylist() if r["finished"])
    selector = f'li.node[data-tree="{leaf["tree_id"]}"][data-node="{leaf["node_id"]}"] > .row'
    ActionChains(browser).move_to_element(browser.find_element(By.CSS_SELECTOR, selector)).perform()
    details = browser.find_element(By.ID, "details")
    heading = f"group {leaf['group_id']} · tree {leaf['tree_id']} · node {leaf['node_id']}"
    assert details.find_element(By.TAG_NAME, "h2").text == heading
    assert details.find_element(By.CSS_SELECTOR, "pre.action").text == leaf["action_text"]

    select.select_by_visible_text("step 1")
    step1, _ = read_saved_trees(run_dir, 1)
    assert len(browser.find_elements(By.CSS_SELECTOR, "li.node")) == step1.num_rows


def test_a_long_observation_is_cut_with_show_more_not_dropped(browser, tmp_path):
    tree = Tree(tree_id=0, group_id=0, prompt_ids=[1])
    tree.add(ROOT, action_ids=[5], action_logprobs=[-0.1], obs_ids=list(range(400)),
             finished=False, finish_reason="stop", policy_version=0, role="search",
             tool_call=True)  # fmt: skip
    for reward in (1.0, 0.0):
        tree.add(0, action_ids=[6], action_logprobs=[-0.2], obs_ids=[], finished=True,
                 finish_reason="done", policy_version=0, role="answer", tool_call=False,
                 reward=reward)  # fmt: skip
    batch = pack_trees([tree], 1024, pad_token_id=0)
    advantages = torch.tensor([1.0, -1.0])
    routed = node_advantages([tree], advantages, batch.route_nodes(advantages, "paper"))
    decode = lambda ids: " ".join(f"passage{i}" for i in ids)  # noqa: E731
    write_saved_trees(tmp_path, 1, saved_trees_table([tree], routed, decode, {"step": 1}))
    _open(browser, tmp_path)

    full = decode(range(400))
    obs = browser.find_element(By.CSS_SELECTOR, 'li.node[data-node="0"] > .row .obs')
    shown = obs.find_element(By.CSS_SELECTOR, ".text")
    assert shown.text == full[:160] + "…"
    obs.find_element(By.CSS_SELECTOR, "button.more").click()
    assert shown.text == full and len(full) > 3000


def test_the_page_references_nothing_outside_itself(run_dir):
    page = run_dir / "offline.html"
    assert main(["trees", str(run_dir), "--out", str(page)]) == 0
    html = page.read_text()
    assert re.findall(r"https?://|\bsrc=|\bhref=|<link|@import|url\(", html) == []
    assert html.count("<script>") == 1  # the page's own script, inline; the rest is JSON data
