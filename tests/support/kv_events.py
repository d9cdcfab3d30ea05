"""vLLM's KV event stream as a router reads it: a ZMQ SUB socket, each batch decoded by vLLM's msgspec types,
and what was published before the subscription took (ZMQ drops it) asked of the publisher's replay
socket; vLLM's own block hashes of a token sequence, to compare with; and the prefix of a prompt a router
finds announced, over every KV cache group as vLLM finds its own."""

from __future__ import annotations

import threading
import time

import zmq

from support.vllm_hits import vllm_hit


class Stream:
    """The batches published on ``port`` (``tcp://127.0.0.1``), from the first, by their sequence number:
    those the SUB socket got, and those it missed from the replay socket on ``replay_port``, asked as soon as
    a batch shows a gap (while the publisher is there to answer), or, for batches before any came, when
    :meth:`batches` is asked."""

    def __init__(self, port: int, replay_port: int):
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.RECONNECT_IVL, 20)
        self._socket.connect(f"tcp://127.0.0.1:{port}")  # may be before the publisher binds: ZMQ retries
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._replay = f"tcp://127.0.0.1:{replay_port}"
        self.live: dict[int, object] = {}  # seq -> KVEventBatch
        self._next = 0  # the batch expected next
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(50):
                _topic, seq, payload = self._socket.recv_multipart()
                seq = int.from_bytes(seq, "big")
                found = self._gap(self._next) if seq > self._next else {}  # a gap: ask for it now
                with self._lock:
                    self.live.update({s: b for s, b in found.items() if s < seq})
                    self.live[seq] = self._decode(payload)
                self._next = seq + 1

    def batches(self) -> list:
        """Every batch from the first: the live ones, after those replayed from before them."""
        with self._lock:
            live = dict(self.live)
        first = min(live, default=None)
        replayed = self._replayed(0) if first is None or first > 0 else {}
        merged = {**{s: b for s, b in replayed.items() if first is None or s < first}, **live}
        assert sorted(merged) == list(range(len(merged))), f"batches missing: {sorted(merged)}"
        return [merged[s] for s in sorted(merged)]

    def events(self) -> list:
        return [event for batch in self.batches() for event in batch.events]

    def _gap(self, start: int) -> dict[int, object]:
        """The batches from ``start`` the replay socket has, or none if it does not answer (the publisher is
        closing): :meth:`batches` then finds the gap."""
        try:
            return self._replayed(start)
        except AssertionError:
            return {}

    def _replayed(self, start: int) -> dict[int, object]:
        dealer = self._context.socket(zmq.DEALER)
        try:
            dealer.connect(self._replay)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            found = {}
            while True:
                assert dealer.poll(10_000), "the replay socket did not answer"
                _, _topic, seq, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq, "big", signed=True)
                if seq < 0:  # vLLM's end of the replay
                    return found
                found[seq] = self._decode(payload)
        finally:
            dealer.close(linger=0)

    def wait(self, until, timeout_s: float = 60) -> list:
        """The events once ``until(events)`` holds."""
        deadline = time.monotonic() + timeout_s
        while not until(events := self.events()):
            assert time.monotonic() < deadline, f"the events did not come: {events[-10:]}"
            time.sleep(0.2)
        return events

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)


def vllm_hashes(tokens, block_size: int, salt: str | None = None) -> list[int]:
    """vLLM's chain of block hashes over ``tokens`` (sha256, vLLM's fixed seed for it), as its events carry them."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash, maybe_convert_block_hash

    init_none_hash(sha256)  # as an engine seeds it: without PYTHONHASHSEED, the same in every process
    hashes, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = (("cache_salt", salt),) if salt and parent is None else None
        parent = hash_block_tokens(sha256, parent, tokens[start : start + block_size], extra)
        hashes.append(maybe_convert_block_hash(parent))
    return hashes


def stored_blocks(events: list, medium: str, group: int | None = None) -> dict:
    """Block hash -> its token ids, of every block stored on ``medium`` (in KV cache group ``group``: None, any)."""
    from vllm.distributed.kv_events import BlockStored

    blocks = {}
    for event in events:
        if isinstance(event, BlockStored) and event.medium == medium and group in (None, event.group_idx):
            size = event.block_size
            for i, block in enumerate(event.block_hashes):
                blocks[block] = event.token_ids[i * size : (i + 1) * size]
    return blocks


def groups(events: list) -> dict[int, tuple]:
    """Each KV cache group a stream's ``BlockStored`` events name (vLLM's own on ``GPU`` name every group of
    its engine): its index, kind, window and block size."""
    from vllm.distributed.kv_events import BlockStored

    return {
        e.group_idx: (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, e.block_size)
        for e in events
        if isinstance(e, BlockStored)
    }


def announced_hit(events: list, medium: str, prompt: list[int], hash_block: int) -> int:
    """The tokens of ``prompt`` a router finds among the blocks ``events`` leave announced on ``medium``,
    taking a hit as vLLM takes its own over every group of the stream (:func:`groups`), ``hash_block``
    the engine's hash block; as vLLM, never the prompt's last token."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    held = set()
    for e in events:
        if isinstance(e, BlockStored) and e.medium == medium:
            held |= {(e.group_idx, h) for h in e.block_hashes}
        elif isinstance(e, BlockRemoved) and e.medium == medium:
            held -= {(e.group_idx, h) for h in e.block_hashes}
    hashes = vllm_hashes(prompt, hash_block)
    return vllm_hit(lambda g, h: (g, h) in held, list(groups(events).values()), hashes, hash_block, len(prompt) - 1)
