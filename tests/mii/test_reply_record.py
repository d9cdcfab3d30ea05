"""The restore record on a streamed reply (:mod:`hcache.mii.reply_record`): it survives MII's load balancer,
which parses each message and writes it out again, and MII's own reading of the reply ignores it."""

from mii.grpc_related.proto.modelresponse_pb2 import MultiGenerationReply, SingleGenerationReply
from mii.grpc_related.task_methods import TextGenerationMethods

from hcache.mii.reply_record import record_of, with_record
from hcache.restore.records import SequenceRecord


def _reply(text: str) -> MultiGenerationReply:
    return MultiGenerationReply(
        response=[SingleGenerationReply(response=text, finish_reason="none", prompt_tokens=70, generated_tokens=1)]
    )


def test_a_record_crosses_the_load_balancer_and_mii_reads_the_reply_as_before():
    record = SequenceRecord(
        restored_tokens=128, gpu_tokens=64, tier_tokens={"disk": 64}, miss_tokens={"evicted": 64}, plan="KV"
    ).reply()
    sent = with_record(_reply("Paris"), record)
    forwarded = MultiGenerationReply.FromString(
        MultiGenerationReply.FromString(sent.SerializeToString()).SerializeToString()
    )
    assert (
        record_of(forwarded)
        == record
        == {
            "restored_tokens": 128,
            "tier_tokens": {"gpu_cache": 64, "disk": 64},
            "miss_tokens": {"evicted": 64},
            "plan": "KV",
            "lossy": False,
        }
    )
    [response] = TextGenerationMethods().unpack_response_from_proto(forwarded)
    assert (response.generated_text, response.prompt_length, response.generated_length) == ("Paris", 70, 1)


def test_a_reply_without_a_record_reads_none():
    assert record_of(_reply("Paris")) is None
    assert with_record(_reply("Paris"), None) == _reply("Paris")
