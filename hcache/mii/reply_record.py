"""A request's restore record (:meth:`~hcache.serving.engine.ServingEngine.reply`), carried from the model
server to the OpenAI server on the first message of its streamed gRPC reply.

MII's reply message has no field for it, and its load balancer forwards the messages it reads. So the
record rides as a field MII's message does not define (``hcache``, number ``FIELD``, JSON): protobuf
parses such a field as unknown and writes it out again, so it crosses the load balancer untouched, and
MII's own clients ignore it. Appending a message's bytes merges them into it (protobuf's rule), and
parsing a message as another type keeps the fields that type defines: so one small message type both adds
the field and reads it back.
"""

from __future__ import annotations

import json

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

FIELD = 1000  # far from MII's reply fields (1-6)


def _record_type() -> type[Message]:
    proto = descriptor_pb2.FileDescriptorProto(name="hcache/reply_record.proto", package="hcache", syntax="proto3")
    message = proto.message_type.add(name="ReplyRecord")
    message.field.add(
        name="hcache",
        number=FIELD,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("hcache.ReplyRecord"))


_ReplyRecord = _record_type()


def with_record(message: Message, record: dict | None) -> Message:
    """``message`` (a reply of any type) carrying ``record``; unchanged if there is none."""
    if record is None:
        return message
    extra = _ReplyRecord(hcache=json.dumps(record, separators=(",", ":"))).SerializeToString()
    return type(message).FromString(message.SerializeToString() + extra)


def record_of(message: Message) -> dict | None:
    """The record ``message`` carries, if any."""
    carried = _ReplyRecord.FromString(message.SerializeToString()).hcache
    return json.loads(carried) if carried else None
