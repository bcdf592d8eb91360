"""The radix prefix cache: longest match, shared storage, LRU eviction, budget and version reset."""

import logging

import torch

from treegrpo_ray.actors.engines.hf_engine import HFEngine
from treegrpo_ray.actors.engines.prefix_cache import PrefixCache
from treegrpo_ray.config import TinyModelConfig
from treegrpo_ray.engine import GenerationRequest, SamplingParams
from treegrpo_ray.modeling import build_tiny_model

LAYERS, HEADS, DIM = 2, 1, 2
TOKEN_BYTES = LAYERS * 2 * HEADS * DIM * 4  # key + value, fp32


def kv_of(ids):
    """Fake KV whose entries are ``layer * 1000 + token id``, so a match can be checked."""
    row = torch.tensor(ids, dtype=torch.float32)[None, :, None].expand(HEADS, len(ids), DIM)
    return [(row + 1000 * layer, -(row + 1000 * layer)) for layer in range(LAYERS)]


def assert_match(match, ids):
    """``match`` covers exactly ``ids``: its pieces, concatenated, are their KV."""
    assert match.length == len(ids)
    for layer, (key, value) in enumerate(kv_of(ids)):
        got_key = torch.cat([piece[layer][0] for piece in match.pieces], 1)
        got_value = torch.cat([piece[layer][1] for piece in match.pieces], 1)
        torch.testing.assert_close(got_key, key, rtol=0, atol=0)
        torch.testing.assert_close(got_value, value, rtol=0, atol=0)


def test_longest_prefix_match_across_split_edges():
    cache = PrefixCache(max_bytes=10**6)
    cache.insert((1, 2, 3, 4), kv_of([1, 2, 3, 4]))
    cache.insert((1, 2, 5), kv_of([1, 2, 5]))  # splits the first edge after (1, 2)
    assert_match(cache.match((1, 2, 3, 9)), [1, 2, 3])
    assert_match(cache.match((1, 2, 5, 6, 7)), [1, 2, 5])
    assert cache.match((7, 1)).length == 0
    assert cache.stats.bytes == 5 * TOKEN_BYTES  # (1, 2) stored once
    assert (cache.stats.lookups, cache.stats.hits) == (3, 2)


def test_insert_from_a_cached_start_stores_only_the_new_tail():
    cache = PrefixCache(max_bytes=10**6)
    cache.insert((1, 2, 3), kv_of([1, 2, 3]))
    cache.insert((1, 2, 3, 4, 5), kv_of([4, 5]), start=3)
    assert_match(cache.match((1, 2, 3, 4, 5)), [1, 2, 3, 4, 5])
    assert cache.stats.bytes == 5 * TOKEN_BYTES
    cache.insert((9, 9, 6), kv_of([6]), start=2)  # (9, 9) is not cached: nothing to attach to
    assert cache.match((9, 9, 6)).length == 0


def test_least_recently_used_leaf_is_evicted_first():
    cache = PrefixCache(max_bytes=8 * TOKEN_BYTES)
    cache.insert((1, 2, 3, 4), kv_of([1, 2, 3, 4]))
    cache.insert((5, 6, 7, 8), kv_of([5, 6, 7, 8]))
    cache.match((1, 2))  # (1..4) is now more recent than (5..8)
    cache.insert((9, 10, 11), kv_of([9, 10, 11]))
    assert cache.stats.evictions == 1
    assert cache.match((5, 6)).length == 0
    assert cache.match((1, 2, 3, 4)).length == 4
    assert cache.match((9, 10, 11)).length == 3
    assert cache.stats.bytes == 7 * TOKEN_BYTES


def test_eviction_reaches_inner_nodes_once_their_children_are_gone():
    cache = PrefixCache(max_bytes=6 * TOKEN_BYTES)
    cache.insert((1, 2, 3), kv_of([1, 2, 3]))
    cache.insert((1, 2, 4), kv_of([1, 2, 4]))  # (1, 2) inner, (3,) and (4,) leaves
    cache.insert((7, 8, 9, 10, 11), kv_of([7, 8, 9, 10, 11]))
    assert cache.match((1,)).length == 0
    assert cache.stats.evictions == 3
    assert cache.stats.bytes == 5 * TOKEN_BYTES


def test_reset_for_a_new_version_drops_everything():
    cache = PrefixCache(max_bytes=10**6)
    cache.insert((1, 2, 3), kv_of([1, 2, 3]))
    cache.reset(version=1)
    assert cache.match((1, 2, 3)).length == 0
    assert (cache.version, cache.stats.bytes) == (1, 0)


def test_a_budget_below_one_entry_disables_caching_with_a_warning(caplog):
    cache = PrefixCache(max_bytes=2 * TOKEN_BYTES)
    with caplog.at_level(logging.WARNING):
        cache.insert((1, 2, 3), kv_of([1, 2, 3]))
    assert "smaller than one entry" in caplog.text and "engine.cache_bytes" in caplog.text
    assert not cache.enabled
    assert cache.match((1, 2, 3)).length == 0 and cache.stats.bytes == 0


def test_engine_with_a_too_small_budget_still_generates_correctly():
    model = build_tiny_model(TinyModelConfig(), vocab_size=40, seed=0)
    requests = [
        GenerationRequest(tuple(range(3, 3 + n)), SamplingParams(temperature=0.0, max_new_tokens=5))
        for n in (4, 9)
    ]
    tiny_budget = HFEngine(model, pad_token_id=0, cache_bytes=16)
    uncached = HFEngine(model, pad_token_id=0, cache_bytes=0)
    for _ in range(2):
        got = tiny_budget.generate(requests)
        want = uncached.generate(requests)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert [r.cached_tokens for r in got] == [0, 0]
    assert not tiny_budget.cache.enabled
