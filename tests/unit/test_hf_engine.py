"""The embedded engine's continuous batching: slots written in place, rows that leave and join."""

import torch

from treegrpo_ray.actors.engines.hf_engine import HFEngine
from treegrpo_ray.actors.engines.slot_kv import SlotKV
from treegrpo_ray.config import TinyModelConfig
from treegrpo_ray.engine import GenerationRequest, SamplingParams
from treegrpo_ray.modeling import build_tiny_model

VOCAB = 40


def _requests():
    """Prefixes and action lengths of different sizes, sampled with their own seeds, and one
    greedy request."""
    requests = [
        GenerationRequest(
            tuple(range(3, 3 + length)), SamplingParams(1.0, 1.0, max_new, seed=10 + i)
        )
        for i, (length, max_new) in enumerate([(4, 9), (11, 3), (2, 6), (7, 1), (5, 12), (9, 5)])
    ]
    return requests + [GenerationRequest((5, 6, 7), SamplingParams(0.0, 1.0, 7))]


def _run(engine, requests):
    """Submit every request, step until all are done; returns results by request index and the
    most rows that ran at once."""
    for i, request in enumerate(requests):
        engine.submit(request, tag=i)
    results, most = {}, 0
    while engine.pending():
        results.update(engine.step())
        most = max(most, len(engine.running))
    return results, most


def test_a_request_gives_the_same_tokens_whatever_the_batch_bound():
    """With at most 2 sequences in flight, the others wait and join as rows finish; every
    request gets the tokens and log-probs it gets in one batch of all, and the bound holds."""
    model = build_tiny_model(TinyModelConfig(num_layers=2), vocab_size=VOCAB, seed=0).eval()
    requests = _requests()
    unbounded = HFEngine(model, pad_token_id=0, cache_bytes=2**20).generate(requests)
    bounded = HFEngine(model, pad_token_id=0, cache_bytes=2**20, max_num_seqs=2)
    results, most = _run(bounded, requests)
    assert most == 2 and bounded.kv.slots == 2
    for i, want in enumerate(unbounded):
        got = results[i]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
        assert len(got.token_ids) == requests[i].params.max_new_tokens  # no stop: run to length
        torch.testing.assert_close(
            torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0
        )


def test_a_row_joins_in_the_forward_that_decodes_the_others():
    """Each step is one forward: a request that joins a running batch has its prefix computed in
    the forward that decodes the others ("mixed"), not in a prefill of its own."""
    model = build_tiny_model(TinyModelConfig(num_layers=2), vocab_size=VOCAB, seed=0).eval()
    engine = HFEngine(model, pad_token_id=0, max_num_seqs=2)
    engine.trace = []
    requests = _requests()
    for i, request in enumerate(requests):
        engine.submit(request, tag=i)
    steps = 0
    while engine.pending():
        engine.step()
        steps += 1
    assert len(engine.trace) == steps
    # requests 0 and 1 (prefixes of 4 and 11 tokens) start together; 1 ends after its 3 tokens,
    # and at step 4 request 2 (2 tokens) joins request 0, fed its 4 + 2 tokens so far
    first = [(t.kind, t.rows, t.tokens, t.context) for t in engine.trace[:4]]
    assert first == [
        ("prefill", 2, 15, 15),
        ("decode", 2, 2, 17),
        ("decode", 2, 2, 19),
        ("mixed", 2, 3, 7 + 2),
    ]


def test_decoding_equals_a_full_forward_of_the_sampled_path():
    """The KV written in place (compaction moves included) gives the log-probs a plain forward
    of prefix + sampled tokens gives, for every request of a bounded run."""
    model = build_tiny_model(TinyModelConfig(num_layers=2), vocab_size=VOCAB, seed=1).eval()
    engine = HFEngine(model, pad_token_id=0, cache_bytes=0, max_num_seqs=3)
    requests = _requests()
    for request, result in zip(requests, engine.generate(requests), strict=True):
        ids = torch.tensor([*request.prefix_ids, *result.token_ids])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(request.prefix_ids) - 1 : -1]
        temperature = request.params.temperature or 1.0
        want = torch.log_softmax(logits / temperature, -1)
        want = want.gather(-1, torch.tensor(result.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(result.logprobs), want, atol=1e-5, rtol=0)


def test_slots_grow_and_keep_what_they_hold():
    kv = SlotKV(layers=2, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    kv.reserve(slots=1, capacity=4)
    written = [
        (torch.full((1, 3, 2), 1.0 + layer), torch.full((1, 3, 2), -1.0)) for layer in (0, 1)
    ]
    kv.write(0, 0, written)
    kv.reserve(slots=3, capacity=10)
    assert kv.slots == 3 and kv.capacity >= 10
    for (key, value), (want_key, want_value) in zip(kv.read(0, 0, 3), written, strict=True):
        assert torch.equal(key, want_key) and torch.equal(value, want_value)
    kv.move(0, 2, 3)
    assert torch.equal(kv.read(2, 0, 3)[1][0], written[1][0])


def test_a_packed_forward_is_placed_row_by_row():
    """Two decoding rows (4 and 2 tokens in their slots) and a joining row feeding 2 tokens after
    3 cached ones: positions, masks, and where ``update`` writes, by hand."""
    kv = SlotKV(layers=1, kv_heads=1, head_dim=1, dtype=torch.float32, device=torch.device("cpu"))
    kv.reserve(slots=3, capacity=6)
    positions, plan = kv.begin(torch.tensor([4, 2, 3]), torch.tensor([1, 1, 2]), decoding=2)
    assert positions.tolist() == [[4, 2, 3, 4]]
    inf = float("-inf")
    assert (plan.decoding, plan.decode_width) == (2, 5)
    assert plan.decode_mask is not None
    assert plan.decode_mask[:, 0, 0].tolist() == [[0, 0, 0, 0, 0], [0, 0, 0, inf, inf]]
    (joining,) = plan.joining
    assert (joining.slot, joining.start, joining.count, joining.width) == (2, 2, 2, 5)
    assert joining.mask[0, 0].tolist() == [[0, 0, 0, 0, inf], [0, 0, 0, 0, 0]]
    keys, _ = kv.update(torch.tensor([1.0, 2, 3, 4]).view(1, 1, 4, 1), torch.zeros(1, 1, 4, 1), 0)
    written = {
        (slot, column): keys[slot, 0, column, 0].item()
        for slot, column in keys[..., 0].nonzero()[:, [0, 2]].tolist()
    }
    assert written == {(0, 4): 1.0, (1, 2): 2.0, (2, 3): 3.0, (2, 4): 4.0}


def test_a_kv_byte_budget_bounds_the_batch_and_changes_no_token():
    """Under a budget of about three sequences' KV the engine never holds more, requests wait
    their turn, and every request still gets the tokens it gets without a bound."""
    model = build_tiny_model(TinyModelConfig(num_layers=2), vocab_size=VOCAB, seed=2).eval()
    requests = _requests()
    free = HFEngine(model, pad_token_id=0).generate(requests)
    probe = HFEngine(model, pad_token_id=0)
    longest = max(len(r.prefix_ids) + r.params.max_new_tokens for r in requests) + 1
    budget = 3 * int(1.5 * longest) * probe.kv.token_bytes()
    bounded = HFEngine(model, pad_token_id=0, max_kv_bytes=budget)
    results, most = _run(bounded, requests)
    assert 1 < most < len(requests)
    assert 0 < bounded.peak_kv_bytes <= budget
    assert [results[i].token_ids for i in range(len(requests))] == [r.token_ids for r in free]


def test_near_the_memory_limit_no_row_joins_a_running_batch_and_no_token_changes():
    """While the node is near Ray's kill threshold (a test double: this machine is not), rows
    already running finish but none joins them, the KV slots shrink to the running rows, each
    request still gets its own tokens, and once the pressure is gone rows join again."""
    model = build_tiny_model(TinyModelConfig(num_layers=2), vocab_size=VOCAB, seed=3).eval()
    requests = _requests()
    free = HFEngine(model, pad_token_id=0).generate(requests)
    pressed = {"now": False}
    engine = HFEngine(model, pad_token_id=0, memory_pressed=lambda: pressed["now"])
    for i, request in enumerate(requests[:4]):
        engine.submit(request, tag=i)
    results = dict(engine.step())
    assert len(engine.running) == 4 - len(results) > 1
    pressed["now"] = True
    for i, request in enumerate(requests[4:], start=4):
        engine.submit(request, tag=i)
    while engine.pending() and len(results) < 5:
        before = len(engine.running)
        results.update(engine.step())
        assert len(engine.running) <= max(1, before)  # one joins only an empty batch
        assert engine.kv.slots <= max(1, before)  # the slots shrank to the running rows
    assert engine.memory_throttles > 0
    assert engine.cache_stats().memory_throttles == engine.memory_throttles
    pressed["now"] = False
    results.update(_run(engine, [])[0])
    assert [results[i].token_ids for i in range(len(requests))] == [r.token_ids for r in free]


def test_max_model_len_ends_rows_there_and_bounds_the_slots():
    model = build_tiny_model(TinyModelConfig(num_layers=2), vocab_size=VOCAB, seed=4).eval()
    request = GenerationRequest(tuple(range(3, 13)), SamplingParams(1.0, 1.0, 50, seed=1))
    free = HFEngine(model, pad_token_id=0).generate([request])[0]
    capped = HFEngine(model, pad_token_id=0, max_model_len=16)
    result = capped.generate([request])[0]
    assert result.finish_reason == "context" and len(result.token_ids) == 16 - 10
    assert result.token_ids == free.token_ids[:6]
    assert capped.kv.capacity <= 17


def test_samples_of_one_prefix_joining_together_prefill_it_once():
    """Six samples of one prompt and one other request join in one prefill: the prompt is
    computed once, the copies take its KV and logits, and every request gets the tokens and
    log-probs it gets alone (its own seed)."""
    model = build_tiny_model(TinyModelConfig(num_layers=2), vocab_size=VOCAB, seed=2).eval()
    prompt, other = tuple(range(3, 15)), (7, 8, 9, 10)
    requests = [
        GenerationRequest(prompt, SamplingParams(1.0, 1.0, 6, seed=20 + i)) for i in range(6)
    ]
    requests.insert(2, GenerationRequest(other, SamplingParams(1.0, 1.0, 6, seed=30)))
    engine = HFEngine(model, pad_token_id=0, cache_bytes=2**20)
    together = engine.generate(requests)
    assert sum(r.prefill_tokens for r in together) == len(prompt) + len(other)
    assert [r.cached_tokens for r in together] == [0, len(prompt), 0] + [len(prompt)] * 4
    for request, got in zip(requests, together, strict=True):
        alone = HFEngine(model, pad_token_id=0, cache_bytes=2**20).generate([request])[0]
        assert got.token_ids == alone.token_ids
        torch.testing.assert_close(
            torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0
        )
    stats = engine.cache_stats()
    assert (stats.lookups, stats.hits) == (7, 5)
