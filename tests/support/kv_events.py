"""vLLM's KV cache event stream as a router reads it: a ZMQ SUB socket, each batch decoded by vLLM's own
msgspec types."""

import threading

import zmq


class Subscriber:
    """Every event published on ``ports`` (each an engine's ``--kv-events-config`` endpoint), as they come."""

    def __init__(self, ports: list[int]):
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        for port in ports:
            self._socket.connect(f"tcp://127.0.0.1:{port}")
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.events: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(100):
                _topic, _seq, payload = self._socket.recv_multipart()
                self.events.extend(self._decode(payload).events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)


def stored_blocks(events: list, medium: str) -> dict:
    """Block hash -> its token ids, of every block stored on ``medium``."""
    from vllm.distributed.kv_events import BlockStored

    blocks = {}
    for event in events:
        if isinstance(event, BlockStored) and event.medium == medium:
            size = event.block_size
            for i, block in enumerate(event.block_hashes):
                blocks[block] = event.token_ids[i * size : (i + 1) * size]
    return blocks
