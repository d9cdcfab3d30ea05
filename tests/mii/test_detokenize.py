"""The text of generated tokens (hcache/mii/detokenize.py): a stream decoded piece by piece joins to the
whole reply decoded at once, special tokens never appear, and a stream cut short (a client gone mid-way)
leaves nothing behind for the thread's next stream."""

from transformers import AutoTokenizer

from hcache.mii.detokenize import STOPPED, StreamDecoders
from hcache.model.loader import model_dir

TEXT = "Héllo wörld 🎉, naïve café. Paris!"


class _MIITokenizer:  # MII's wrapper: the HF tokenizer is its ``tokenizer``
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


def test_a_stream_joins_to_the_whole_reply_without_special_tokens(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir("smollm2")))
    ids = tokenizer.encode(TEXT) + [tokenizer.eos_token_id]
    decoders = StreamDecoders(_MIITokenizer(tokenizer))
    pieces = [decoders.decode(7, [i]) for i in ids]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert "<|im_end|>" not in "".join(pieces) and "\ufffd" not in "".join(pieces)


def test_a_stream_cut_mid_character_leaves_the_next_stream_clean(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir("smollm2")))
    emoji = tokenizer.encode("🎉")
    assert len(emoji) > 1  # a character over several byte tokens: the cut falls inside it
    decoders = StreamDecoders(_MIITokenizer(tokenizer))
    assert decoders.decode(7, emoji[:1]) == ""  # held back: not a whole character yet
    decoders.flush_state(7)  # what the model server does for a stream that ended early
    assert "".join(decoders.decode(7, [i]) for i in tokenizer.encode(" Paris")) == " Paris"


def test_skip_special_tokens_false_keeps_them_and_the_stop_marker_never_decodes(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir("smollm2")))
    ids = tokenizer.encode(" Paris") + [tokenizer.eos_token_id]
    decoders = StreamDecoders(_MIITokenizer(tokenizer))
    decoders.skip_special_tokens[7] = False  # as the request's make_request sets it for its thread
    assert "".join(decoders.decode(7, [i]) for i in [*ids, STOPPED]) == " Paris<|im_end|>"
    assert "".join(decoders.decode(8, [i]) for i in [*ids, STOPPED]) == " Paris"  # another thread: the default
