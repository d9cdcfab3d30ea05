"""Which tokens end a request in MII's loop (``hcache.mii.stopping``): MII's own stop criteria and sampler,
the rule applied around them. Through a served deployment and the ``openai`` client: tests/openai."""

from __future__ import annotations

import queue
from collections import deque
from types import SimpleNamespace

import pytest
import torch
from mii.batching.data_classes import RequestBatch
from mii.batching.generation.stop_criterion import EosGenerationStopCriterion, TokenStopCriterion

from hcache.errors import InvalidRequestError
from hcache.mii import failures
from hcache.mii.detokenize import STOPPED
from hcache.mii.requests import check_generate_options
from hcache.mii.stopping import as_asked, counting_new_tokens, leaving_out_stop_tokens, parse_stop_token_ids

EOS, VOCAB = 2, 8


def _request(generated: int, least: int = 0, stop_ids=(), ignore_eos: bool = False, criteria=("Stop",)):
    return SimpleNamespace(
        num_generated_tokens=generated,
        min_new_tokens=least,
        hcache_stop_ids=tuple(stop_ids),
        ignore_eos=ignore_eos,
        post_processing=list(criteria),
    )


def _sample(requests, best: list[list[int]]):
    """Sample greedily with the logits ranking ``best`` tokens first for each request."""
    logits = torch.zeros(len(requests), VOCAB)
    for row, ranked in enumerate(best):
        for rank, token in enumerate(ranked):
            logits[row, token] = 10.0 - rank
    loop = SimpleNamespace(
        vocab_size=VOCAB,
        _post_processors={
            "Stop": EosGenerationStopCriterion(SimpleNamespace(eos_token_id=EOS)),
            "Stop_5": TokenStopCriterion(5, tokenizer=None),
        },
    )
    greedy = lambda self, logits, running: (logits.argmax(-1), torch.zeros(len(running), dtype=torch.bool))  # noqa: E731
    tokens, done = as_asked(greedy)(loop, logits, RequestBatch(requests))
    return tokens.tolist(), done.tolist()


def test_stop_tokens_cannot_end_a_request_before_its_min_new_tokens_and_end_it_after():
    requests = [
        _request(3, least=3),  # the third token of at least three: the end of sequence is masked
        _request(4, least=3),  # the fourth: it may end
        _request(1, stop_ids=[6]),  # a stop token id of its own ends it
        _request(1, least=2, stop_ids=[6]),  # ... but not before min_new_tokens either
        _request(1, ignore_eos=True),  # the end of sequence is sampled and ends nothing
        _request(1, ignore_eos=True, stop_ids=[6]),  # its own stop ids still end it
        _request(0, least=5),  # a prompt still being split: nothing sampled counts
        _request(2, least=4, criteria=("Stop_5",)),  # MII's `stop` tokens replace the end of sequence
    ]
    best = [[EOS, 4], [EOS, 4], [6, EOS], [6, EOS, 4], [EOS, 4], [6, 4], [EOS, 4], [5, EOS, 4]]
    tokens, done = _sample(requests, best)
    assert tokens == [4, EOS, 6, 4, EOS, 6, EOS, EOS]
    assert done == [False, True, True, False, False, True, True, False]
    assert [r.hcache_stopped for r in requests] == done


def test_a_request_is_done_as_its_sampled_token_says():
    owner = type("Request", (), {"is_done": property(lambda self: False, lambda self, v: setattr(self, "_is_done", v))})
    owner.is_done = counting_new_tokens(owner.is_done)
    r = owner()
    r.is_done = True
    assert r.is_done is True  # MII's getter held it back by the sequence's length and ignore_eos


@pytest.mark.parametrize("value, ids", [("2,17", (2, 17)), ("5", (5,)), ([3, 4], (3, 4)), (" 7 , 8", (7, 8))])
def test_stop_token_ids_are_token_ids(value, ids):
    assert parse_stop_token_ids(value) == ids
    assert check_generate_options({"stop_token_ids": value, "max_new_tokens": 4}, 10, 64)[1].stop_ids == ids


@pytest.mark.parametrize("value", ["", "a,b", "-1", "2,,3", [], [-1], [True], 2.5, "1.5"])
def test_anything_else_is_refused_naming_the_field(value):
    with pytest.raises(InvalidRequestError, match="stop_token_ids must be token ids"):
        parse_stop_token_ids(value)


def test_min_new_tokens_beyond_max_new_tokens_is_refused():
    assert check_generate_options({"min_new_tokens": 4, "max_new_tokens": 4}, 10, 64)[0]["min_new_tokens"] == 4
    with pytest.raises(InvalidRequestError, match="min_new_tokens must be between 0 and max_new_tokens, not 5"):
        check_generate_options({"min_new_tokens": 5, "max_new_tokens": 4}, 10, 64)


@pytest.mark.parametrize("include", [False, True])
def test_a_streams_stop_token_is_sent_as_no_text_unless_asked(include):
    sent = []
    r = SimpleNamespace(stream=True, hcache_stopped=True, hcache_include_stop=include, next_token=torch.tensor(6))
    leaving_out_stop_tokens(lambda self, r: sent.append(int(r.next_token)))(None, r)
    assert sent == [6 if include else STOPPED]


@pytest.mark.parametrize("option", [{"skip_special_tokens": False}, {"include_stop_str_in_output": True}])
def test_text_options_are_for_streams_only(option):
    assert check_generate_options({**option, "stream": True}, 10, 64)[1] is not None
    with pytest.raises(InvalidRequestError, match="only supported with stream=true"):
        check_generate_options(option, 10, 64)


def test_a_requests_constraints_mask_its_row_before_mii_samples_and_see_the_token_sampled():
    accepted = []
    constraints = SimpleNamespace(
        mask=lambda row, generated, temperature: row.masked_fill_(torch.arange(VOCAB) != 3, -torch.inf),
        accept=accepted.append,
        lookback=0,
    )
    requests = [_request(1), _request(2)]
    requests[0].hcache_constraints = constraints
    for r in requests:
        r.generated_tokens, r.generate_params = [], SimpleNamespace(do_sample=False, temperature=None)
    tokens, _ = _sample(requests, [[4, 3], [4, 3]])
    assert tokens == [3, 4] and accepted == [3]  # the first row held to token 3; the second left alone


def _constrained(request, mask, accept=lambda token: None, lookback=0, grammar=False):
    request.hcache_constraints = SimpleNamespace(
        mask=mask, accept=accept, lookback=lookback, matcher=object() if grammar else None
    )
    request.generated_tokens, request.generate_params = [], SimpleNamespace(do_sample=True, temperature=1.0)
    return request


def _only(token: int):
    return lambda row, generated, temperature: row.masked_fill_(torch.arange(VOCAB) != token, -torch.inf)


def test_a_mask_reads_only_the_tokens_a_bad_word_needs():
    seen = []
    r = _constrained(_request(11), lambda row, generated, temperature: seen.append(generated), lookback=2)
    r.generated_tokens = [torch.tensor(t) for t in range(10)]
    _sample([r], [[4]])
    assert seen == [[8, 9]]  # not the whole generation, at every step


def test_a_grammar_that_allows_only_its_end_ends_before_min_new_tokens():
    requests = [_constrained(_request(2, least=5), _only(EOS), grammar=True), _request(2, least=5)]
    tokens, done = _sample(requests, [[4, EOS], [EOS, 4]])
    assert tokens == [EOS, 4] and done == [True, False]  # the grammar's row ends; the other is still held


def _failing_loop(requests):
    """A loop for :func:`as_asked` whose requests can fail alone (hcache.mii.failures)."""
    for tid, r in enumerate(requests):
        r.uid, r.tid, r.is_flush_request, r.hcache_call = 100 + tid, tid, False, failures._Call()
    flushed = []
    return SimpleNamespace(
        vocab_size=VOCAB,
        _post_processors={"Stop": EosGenerationStopCriterion(SimpleNamespace(eos_token_id=EOS))},
        is_rank_0=True,
        model_config=SimpleNamespace(tensor_parallel=1),
        request_queue=queue.Queue(),
        buffer=deque(),
        scheduled_requests=RequestBatch(list(requests)),
        result_queues={r.tid: queue.Queue() for r in requests},
        inference_engine=SimpleNamespace(flush=flushed.append),
        flushed=flushed,
    )


def _sampling(self, logits, running):
    """MII's sampler: a row of -inf gives NaN probabilities, which multinomial refuses."""
    return torch.multinomial(torch.softmax(logits, -1), 1).squeeze(1), torch.zeros(len(running), dtype=torch.bool)


@pytest.mark.parametrize(
    "blocked",
    [
        dict(mask=lambda row, generated, temperature: row.fill_(-torch.inf)),  # e.g. allowed ids off the grammar
        dict(mask=_only(EOS), grammar=False),  # only a stop token, held by min_new_tokens: no grammar to end
        dict(mask=_only(4), accept=lambda token: _reject(token)),  # the grammar rejects what was sampled
    ],
    ids=["masked", "held", "rejected"],
)
def test_a_request_its_masks_leave_no_token_fails_alone(blocked):
    requests = [_constrained(_request(2, least=5), **blocked), _constrained(_request(2), _only(3))]
    loop = _failing_loop(requests)
    batch = RequestBatch(list(requests))
    tokens, done = as_asked(_sampling)(loop, torch.zeros(2, VOCAB), batch)
    assert tokens.tolist() == [3] and done.tolist() == [False] and batch.requests == [requests[1]]
    with pytest.raises(InvalidRequestError, match="no token is left|rejected the token"):
        list(loop.result_queues[0].get_nowait())
    assert loop.flushed == [100] and loop.result_queues[1].empty()


def _reject(token):
    raise InvalidRequestError(f"the structured output rejected the token sampled ({token})")
