"""A request's constraints on its next token (hcache/mii/constraints.py), applied to logits as MII's loop
applies them: with random logits (a model that knows nothing), every constrained generation still conforms
and ends once its grammar is complete. Through a served deployment: tests/openai."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoTokenizer

from hcache.errors import InvalidRequestError
from hcache.mii.constraints import Constraints, structured_option
from hcache.model.loader import model_dir

VOCAB = 49152  # SmolLM2's


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return AutoTokenizer.from_pretrained(str(model_dir("smollm2")))


def _made(tokenizer, **options) -> Constraints:
    return Constraints.take(dict(options)).for_model(tokenizer, VOCAB)


def _generate(made: Constraints, eos: int, max_tokens: int = 400, temperature: float | None = 1.0):
    """Tokens sampled from random logits under ``made``'s mask (the end of sequence favoured, so that a
    generation may end as soon as its grammar allows), and whether it ended."""
    rng, tokens = torch.Generator().manual_seed(0), []
    for _ in range(max_tokens):
        logits = torch.randn(VOCAB, generator=rng)
        logits[eos] += 8
        made.mask(logits, tokens, temperature)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=rng))
        made.accept(token)
        if token == eos:
            return tokens, True
        tokens.append(token)
    return tokens, False


SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Berlin"]}, "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
CASES = [  # (kind, value, check of the text); any JSON (kind "json", no schema) is tested with a real model
    # in tests/openai: a random one opens a string and seldom closes it
    ("regex", r"[a-z]{3}-[0-9]{2}", lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t)),
    ("grammar", 'root ::= "yes" | "no" | "maybe so"', lambda t: t in ("yes", "no", "maybe so")),
    ("json", json.dumps(SCHEMA), lambda t: json.loads(t)["city"] in ("Paris", "Berlin") and json.loads(t)["rank"] < 10),
]


@pytest.mark.parametrize(("kind", "value", "conforms"), CASES, ids=["regex", "grammar", "schema"])
def test_a_random_model_under_a_grammar_conforms_and_ends(tokenizer, kind, value, conforms):
    made = _made(tokenizer, structured_output=structured_option(kind, value))
    tokens, ended = _generate(made, tokenizer.eos_token_id, max_tokens=2000)
    text = tokenizer.decode(tokens)
    assert ended and conforms(text), text


@pytest.mark.parametrize(
    ("kind", "value", "words"),
    [("regex", "(", "parenthesis"), ("json", "{bad", "Failed to parse JSON"), ("grammar", "root ::= ", "EBNF")],
)
def test_a_bad_grammar_is_refused_in_one_line(kind, value, words):
    with pytest.raises(InvalidRequestError, match=words) as refused:
        Constraints.take({"structured_output": structured_option(kind, value)})
    assert "/project/" not in str(refused.value) and "\n" not in str(refused.value)


def test_allowed_token_ids_are_the_only_tokens_sampled(tokenizer):
    allowed = [tokenizer.eos_token_id, *tokenizer.encode(" Paris Berlin")]
    tokens, _ = _generate(_made(tokenizer, allowed_token_ids=",".join(map(str, allowed))), -1, max_tokens=50)
    assert set(tokens) <= set(allowed) and len(set(tokens)) > 1
    with pytest.raises(InvalidRequestError, match="below the vocabulary"):
        _made(tokenizer, allowed_token_ids=str(VOCAB))


def test_bad_words_are_never_completed_alone_or_after_a_space(tokenizer):
    made = _made(tokenizer, bad_words=json.dumps(["Paris", "Hello world"]))
    paris, spaced = tokenizer.encode("Paris"), tokenizer.encode(" Paris")
    hello, world = tokenizer.encode("Hello world"), tokenizer.encode(" world")
    logits = torch.zeros(VOCAB)
    made.mask(logits, tokenizer.encode("The capital is"), None)
    assert logits[paris[-1]] == logits[spaced[-1]] == -torch.inf  # one-token words, either way
    assert logits[world[-1]] == 0  # " world" is fine on its own ...
    made.mask(logits, hello[:-1], None)
    assert logits[hello[-1]] == -torch.inf  # ... but not after "Hello"
    with pytest.raises(InvalidRequestError, match="bad_words must be"):
        Constraints.take({"bad_words": json.dumps(["ok", ""])})


def test_min_p_drops_the_unlikely_when_sampling_and_nothing_when_greedy():
    made = Constraints.take({"min_p": 0.2})
    logits = torch.log(torch.tensor([0.5, 0.15, 0.3, 0.05]))
    sampled = logits.clone()
    made.mask(sampled, [], 1.0)
    assert torch.isinf(sampled).tolist() == [False, False, False, True]  # 0.05 < 0.2 * 0.5; 0.15 kept
    hot = logits.clone()
    made.mask(hot, [], 4.0)  # at a higher temperature the distribution flattens: all within min_p
    assert not torch.isinf(hot).any()
    greedy = logits.clone()
    made.mask(greedy, [], None)
    assert torch.equal(greedy, logits)
    with pytest.raises(InvalidRequestError, match="min_p must be"):
        Constraints.take({"min_p": 1.5})


def _to_its_end(tokenizer, made: Constraints) -> None:
    """Generate greedily from zero logits until ``made``'s grammar has taken its stop token."""
    for _ in range(20):
        logits = torch.zeros(VOCAB)
        made.mask(logits, [], None)
        token = int(logits.argmax())
        made.accept(token)
        if token == tokenizer.eos_token_id:
            return
    raise AssertionError("the grammar did not end")


def test_a_grammar_ended_masks_nothing_more_as_in_vllm(tokenizer):
    made = _made(tokenizer, structured_output=structured_option("grammar", 'root ::= "yes" | "no"'))
    _to_its_end(tokenizer, made)  # under ignore_eos the end of sequence ends nothing: generation goes on
    logits = torch.zeros(VOCAB)
    made.mask(logits, [], None)
    made.accept(int(tokenizer.encode("maybe")[0]))
    assert torch.isfinite(logits).all()


def test_a_token_the_grammar_rejects_fails_the_request(tokenizer):
    made = _made(tokenizer, structured_output=structured_option("grammar", 'root ::= "yes" | "no"'))
    with pytest.raises(InvalidRequestError, match="rejected the token sampled"):
        made.accept(int(tokenizer.encode("maybe")[0]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the logits' device is a GPU's only with CUDA")
def test_a_grammar_masks_logits_on_the_gpu(tokenizer):
    made = _made(tokenizer, structured_output=structured_option("grammar", 'root ::= "yes" | "no"'))
    logits = torch.zeros(VOCAB, device="cuda")
    made.mask(logits, [], None)
    allowed = torch.isfinite(logits).nonzero().flatten().tolist()
    assert logits.device.type == "cuda" and 0 < len(allowed) < 10
    assert all(tokenizer.decode([t]) in ("y", "ye", "yes", "n", "no") for t in allowed)


def test_a_bad_word_with_leading_spaces_is_stripped_of_them_as_in_vllm(tokenizer):
    made = _made(tokenizer, bad_words=json.dumps([" Paris"]))
    logits = torch.zeros(VOCAB)
    made.mask(logits, [], None)
    assert logits[tokenizer.encode("Paris")[-1]] == logits[tokenizer.encode(" Paris")[-1]] == -torch.inf


def test_a_mask_reads_back_only_as_far_as_its_longest_bad_word(tokenizer):
    assert _made(tokenizer, bad_words=json.dumps(["Paris"])).lookback == 0
    assert _made(tokenizer, bad_words=json.dumps(["Paris", "Hello big world"])).lookback == 2
