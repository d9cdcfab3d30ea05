"""Restore records (``restore/records.py``): misses carried as :class:`MissReason`, which reads as its value
wherever it is written (a log line, a label, JSON); a sequence's record sums its puts; a reply tells a client
``never_stored`` for a prefix stored under another model, salt or layout."""

import json

from hcache.restore.records import MissReason, PutRestore, SequenceRecord
from hcache.storage.chunk_key import CHUNK_TOKENS
from hcache.storage.chunk_store import Loss


def test_a_reason_reads_as_its_value_wherever_it_is_written():
    reason = MissReason.OTHER_CACHE_SALT
    assert (str(reason), f"{reason}", "%s" % reason) == ("other_cache_salt",) * 3
    assert json.dumps({reason: 1}) == '{"other_cache_salt": 1}'
    assert {reason: 1} == {"other_cache_salt": 1}  # equal to its value, and hashed as it
    assert MissReason.of(Loss.EVICTED) is MissReason.EVICTED
    assert MissReason.of(Loss.FAILED_VERIFICATION) is MissReason.FAILED_VERIFICATION


def test_a_record_sums_its_puts_misses_and_a_reply_hides_whose_prefix_it_was():
    record = SequenceRecord()
    record.add(PutRestore(misses={MissReason.OTHER_MODEL: 2 * CHUNK_TOKENS}))
    record.add(PutRestore(misses={MissReason.NEVER_STORED: CHUNK_TOKENS, MissReason.EVICTED: CHUNK_TOKENS}))
    record.add(PutRestore(misses={MissReason.EVICTED: CHUNK_TOKENS}))
    assert record.miss_tokens == {
        MissReason.OTHER_MODEL: 2 * CHUNK_TOKENS,
        MissReason.NEVER_STORED: CHUNK_TOKENS,
        MissReason.EVICTED: 2 * CHUNK_TOKENS,
    }
    assert all(type(reason) is MissReason for reason in record.miss_tokens)
    assert record.reply()["miss_tokens"] == {"never_stored": 3 * CHUNK_TOKENS, "evicted": 2 * CHUNK_TOKENS}
