"""A failure inside MII's generation loop fails only the call it belongs to, reaches that call's client as a clear
error, and the loop goes on serving every other request.

MII runs all of a replica's requests in one generation thread (``MIIAsyncPipeline``; a pipeline runs them in
its caller's): an exception there ends it, and every later request waits forever. These replacements of
MII's methods (installed by :mod:`hcache.mii.patches`) change that:

- A ``put`` that raises is retried one sequence at a time, since which sequence of a batch caused it is
  unknown: each is flushed and recomputed alone (restoring what the store holds); one that fails alone
  fails its call, the others go on. A request its sampling finds at fault (its constraints leave it no
  token) fails alone (:func:`failing_alone`). Any other exception in a loop step fails the unfinished calls
  of the batch it ran. One in a ``flush`` (the reply is sent already) is logged.
- A call (a gRPC ``GeneratorReply``, a pipeline ``__call__``) fails as a whole: its requests leave MII's
  queues and the engine, any it still sends are dropped, and the result queue it reads gets the error in
  place of a result. MII keeps one result queue per gRPC thread and a thread serves one call at a time; the
  queue is drained when the call ends, so nothing of a failed call reaches that thread's next one.
- The model server answers a failed call with a gRPC status (INVALID_ARGUMENT for a bad request, INTERNAL
  otherwise) and the error's message; the load balancer passes it on; the REST gateway and the OpenAI server
  answer HTTP 400, 503 (the deployment is unreachable) or 500 with it (:func:`hcache.mii.gateway.http_status`).

With tensor parallelism above 1 every rank must make the same puts, which a retry on one rank would break:
there a failure stops the loop, as in MII.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import torch

from ..errors import HCacheError, InvalidRequestError
from .reply_record import with_record

log = logging.getLogger(__name__)


DROP_WAIT_S = 60  # the longest a cancelled stream waits for the loop to drop its request (one step, normally)


class RequestFailed(HCacheError):
    """A request that the model server failed to serve, for a reason other than its content."""


class Cancelled(HCacheError):
    """The client of a call went away (or cancelled it) before its generation finished."""


class _Call:
    """One client call, whose requests fail together; ``error`` once one has failed or the client has
    cancelled the call (``cancelled``), ``uids`` the requests it made."""

    error: Exception | None = None
    cancelled = False

    def __init__(self) -> None:
        self.uids: list[int] = []

    def cancel(self) -> None:
        """From any thread: the loop drops the call's requests at its next step, answering each reader."""
        if self.error is None:
            self.cancelled, self.error = True, Cancelled("the client cancelled the call")


class _Failure:
    """Stands in a result queue for a failed call's next result. MII's readers unpack a result (as a tuple or
    by index); unpacking this raises the call's error in the reader's thread."""

    def __init__(self, error: Exception):
        self.error = error

    def __iter__(self):
        raise self.error

    def __getitem__(self, index):
        raise self.error


def client_error(exc: BaseException) -> Exception:
    """What a failed call's client is told: a bad request as such, anything else as the server's failure."""
    if isinstance(exc, InvalidRequestError):
        return exc
    return RequestFailed(f"the model server failed this request: {type(exc).__name__}: {exc}")


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    return grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, InvalidRequestError) else grpc.StatusCode.INTERNAL


# ---- the generation loop ----------------------------------------------------------------------------------
def _isolating(pipeline) -> bool:
    return pipeline.is_rank_0 and pipeline.model_config.tensor_parallel == 1


def _calls(pipeline) -> dict[int, _Call]:
    """The call each thread is serving, by thread id (MII's ``tid``)."""
    return pipeline.__dict__.setdefault("hcache_calls", {})


@contextmanager
def _serving_call(pipeline, tid: int) -> Iterator[_Call]:
    """For the length of one call on thread ``tid``: its requests are one call; after it, what is left of it
    in the thread's result queue (a failure not read) is dropped."""
    _calls(pipeline)[tid] = call = _Call()
    try:
        yield call
    finally:
        del _calls(pipeline)[tid]
        results = pipeline.result_queues.get(tid)
        while results is not None and not results.empty():
            results.get_nowait()


def joining_its_call(make):
    def make_request(self, tid, uid, input_tokens, kwargs):
        call = _calls(self).get(tid) or _Call()
        if call.error is not None:  # another of its prompts failed: nobody waits for this one
            raise call.error
        request = make(self, tid, uid, input_tokens, kwargs)
        request.hcache_call = call
        call.uids.append(uid)
        return request

    return make_request


def failing_the_batch(generate):
    def generate_step(self):
        batch = self.scheduled_requests  # what this step runs
        try:
            return generate(self)
        except Exception as exc:
            if not _isolating(self):
                raise
            log.exception("a step of MII's generation loop failed; its unfinished requests fail")
            from mii.constants import GenerationFinishReason

            unfinished = [
                r for r in batch.requests if not r.is_flush_request and r.finish_reason == GenerationFinishReason.NONE
            ]
            _fail(self, unfinished, exc)
            self._reset_scheduler_bookkeeping()

    return generate_step


def retrying_alone(put):
    def put_isolated(self, uids, tokenized_input):
        try:
            return put(self, uids, tokenized_input)
        except Exception as exc:
            if not _isolating(self):
                raise
            batch = self.scheduled_requests
            running = batch.requests_to_run.requests
            survivors, logits = [], []
            for r in running:
                if r.hcache_call.error is not None:  # failed with another of its call's prompts
                    continue
                error = exc
                if len(running) > 1:
                    try:
                        logits.append(_put_alone(self, put, r))
                        survivors.append(id(r))
                        continue
                    except Exception as alone:
                        error = alone
                log.error("sequence %d failed in put: %s: %s", r.uid, type(error).__name__, error, exc_info=error)
                _fail(self, [r], error)
            # The step goes on with the survivors only: MII reads the batch after the put.
            batch.requests[:] = [r for r in batch.requests if r.is_flush_request or id(r) in survivors]
            return torch.cat(logits) if logits else torch.empty(0)

    return put_isolated


def _put_alone(pipeline, put, r) -> torch.Tensor:
    """Request ``r``'s sequence from its first token through this step's, recomputed alone (restoring what the
    store holds) in pieces of MII's batch size; its next-token logits."""
    pipeline.inference_engine.flush(r.uid)
    generated = [t.reshape(1).to(r.prompt_tokens.dtype) for t in r.generated_tokens]
    tokens = torch.cat([torch.cat([r.prompt_tokens, *generated])[: r.seq_length], r.input_tokens])
    size = (
        pipeline.model_config.inference_engine_config.state_manager.max_ragged_batch_size
    )  # what the engine was built with
    for start in range(0, len(tokens), size):
        logits = put(pipeline, [r.uid], [tokens[start : start + size]])
    return logits


def flushing_each(flush):
    def flush_each(self, uids):
        for uid in uids:
            try:
                flush(self, [uid])
            except Exception:
                if not _isolating(self):
                    raise
                log.exception("flushing sequence %d failed: its KV blocks are freed, its unsaved state is lost", uid)

    return flush_each


def dropping_failed_calls(schedule):
    def schedule_live(self):
        # A request its call's thread sent just as the call failed: drop it before it runs for nobody.
        while not self.request_queue.empty():
            self.buffer.append(self.request_queue.get_nowait())
        dead = [r for r in self.buffer if not r.is_flush_request and r.hcache_call.error is not None]
        if dead:
            self.buffer = deque(r for r in self.buffer if all(r is not d for d in dead))
            _flush_engine(self, {r.uid for r in dead})
            for r in dead:  # a failed call's reader was answered when it failed; a cancelled one's waits
                if r.hcache_call.cancelled:
                    self.result_queues[r.tid].put_nowait(_Failure(r.hcache_call.error))
        schedule(self)

    return schedule_live


def failing_alone(pipeline, running, failed: dict[int, Exception]) -> list[int]:
    """Fail the requests of batch ``running`` at the indices of ``failed``, each with its own error (its
    sampling found it at fault), and take them (and their calls' others) out of the batch: the indices of
    those left."""
    if not failed:
        return list(range(len(running.requests)))
    if not _isolating(pipeline):
        raise next(iter(failed.values()))
    requests = running.requests
    for i, exc in failed.items():
        log.warning("sequence %d failed in sampling: %s", requests[i].uid, exc)
        _fail(pipeline, [requests[i]], exc)
    kept = [i for i, r in enumerate(requests) if r.hcache_call.error is None]
    running.requests[:] = [requests[i] for i in kept]
    return kept


def _fail(pipeline, requests: list, exc: BaseException) -> None:
    """Fail the calls of ``requests``: every request of theirs leaves MII's queues, the batch and the engine,
    and each call's reader gets the error."""
    calls = {id(r.hcache_call): r.hcache_call for r in requests}
    error = client_error(exc)

    def theirs(r) -> bool:
        return not r.is_flush_request and id(r.hcache_call) in calls

    queued = []
    while not pipeline.request_queue.empty():
        queued.append(pipeline.request_queue.get_nowait())
    for r in queued:
        if not theirs(r):
            pipeline.request_queue.put_nowait(r)
    dropped = [r for r in [*pipeline.buffer, *queued, *pipeline.scheduled_requests.requests, *requests] if theirs(r)]
    pipeline.buffer = deque(r for r in pipeline.buffer if not theirs(r))
    _flush_engine(pipeline, {r.uid for r in dropped})
    for r in requests:
        if r.hcache_call.error is None:
            r.hcache_call.error = error
            pipeline.result_queues[r.tid].put_nowait(_Failure(error))


def _flush_engine(pipeline, uids: set[int]) -> None:
    for uid in uids:
        try:
            pipeline.inference_engine.flush(uid)
        except Exception:
            log.exception("flushing failed sequence %d failed", uid)


def serving_one_call(call):
    def pipeline_call(self, *args, **kwargs):
        with _serving_call(self, self.tid):
            return call(self, *args, **kwargs)

    return pipeline_call


# ---- the model server and the load balancer ---------------------------------------------------------------
def aborting_with_status(reply):
    def generator_reply(self, request, context):
        with _serving_call(self.inference_pipeline, threading.get_ident()):
            try:
                return reply(self, request, context)
            except Exception as exc:
                context.abort(grpc_code(exc), str(client_error(exc)))

    return generator_reply


def ending_cleanly(reply):
    """MII's streamed reply, ended cleanly when its client goes away: the request leaves the loop at its next
    step (rather than generating to its end for nobody), and nothing of it is left in the thread's result
    queue for the thread's next call (MII's own asserts on a stale result). Its first message carries the
    request's restore record (:mod:`hcache.mii.reply_record`), complete once the prompt has run."""

    def generator_reply_stream(self, request, context):
        pipeline, tid = self.inference_pipeline, threading.get_ident()
        with _serving_call(pipeline, tid) as call:
            context.add_callback(call.cancel)  # on the call's end: a no-op once it has finished
            finished = completed = False
            try:
                for i, message in enumerate(reply(self, request, context)):
                    finished = message.response[0].finish_reason != "none"
                    yield with_record(message, pipeline.inference_engine.reply(call.uids[0])) if i == 0 else message
                completed = True  # MII freed the uid and the thread's decoder itself
            except Exception as exc:  # the reader got the call's failure: the loop has dropped its request
                finished = True
                context.abort(grpc_code(exc), str(client_error(exc)))
            finally:
                if not finished:  # closed at a yield: the client went away mid-generation
                    call.cancel()
                    _await_dropped(pipeline, call, tid)
                if not completed:  # MII frees a stream's uid and decoder only when it reads the last message
                    for uid in call.uids:
                        if uid in pipeline.uids:  # still this call's: MII has not freed it
                            pipeline.flush_uid(uid)
                    pipeline.readable_stream.flush_state(tid)

    return generator_reply_stream


def _await_dropped(pipeline, call: _Call, tid: int) -> None:
    """Read thread ``tid``'s results until the cancelled ``call``'s request has finished or been dropped."""
    from mii.constants import GenerationFinishReason

    results = pipeline.result_queues[tid]
    while True:
        try:
            result = results.get(timeout=DROP_WAIT_S)
        except queue.Empty:
            log.error("the generation loop did not drop cancelled request(s) %s in %d s", call.uids, DROP_WAIT_S)
            return
        if isinstance(result, _Failure) or result[4] != GenerationFinishReason.NONE:
            return


def passing_status(intercept):
    """The load balancer answers a call with the status and message the model server gave it (MII's turns
    every one into UNKNOWN, "Exception calling application"); a streamed call is relayed on a call of its
    own to the replica, so that an error ends it at once (MII's relay waits 600 s for a message that never
    comes) and its client going away cancels the replica's call."""

    def intercept_service(self, continuation, handler_call_details):
        replica = self.stubs[self.counter.get() % len(self.stubs)]  # MII's choice, as its own relay makes it
        handler = intercept(self, continuation, handler_call_details)
        if handler.unary_stream is not None:
            method = handler_call_details.method

            def relay(request: bytes, context):  # relayed as bytes: no (de)serialising in between
                call = _replica_channel(replica).unary_stream(method)(request)
                context.add_callback(call.cancel)
                try:
                    yield from call
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.CANCELLED:
                        context.abort(exc.code(), exc.details())

            return grpc.unary_stream_rpc_method_handler(relay)
        if handler.unary_unary is None:
            return handler
        forward = handler.unary_unary

        def passing(request, context):
            try:
                return forward(request, context)
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details())

        return grpc.unary_unary_rpc_method_handler(
            passing, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )

    return intercept_service


def remembering_address(init):
    """Remember the first replica address a load balancer's invoker was made for (it keeps only stubs)."""

    def invoker_init(self, host, ports):
        init(self, host, ports)
        self.hcache_address = f"{host}:{ports[0]}"

    return invoker_init


_channels_made = threading.Lock()


def _replica_channel(invoker) -> grpc.Channel:
    """One synchronous channel per replica, made on first use."""
    with _channels_made:
        channel = invoker.__dict__.get("hcache_channel")
        if channel is None:
            from mii.constants import GRPC_MAX_MSG_SIZE

            options = [
                ("grpc.max_send_message_length", GRPC_MAX_MSG_SIZE),
                ("grpc.max_receive_message_length", GRPC_MAX_MSG_SIZE),
            ]
            channel = invoker.hcache_channel = grpc.insecure_channel(invoker.hcache_address, options=options)
        return channel
