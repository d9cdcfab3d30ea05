"""hcache's OpenAI-compatible server: FastAPI and OpenAI's schema in front of a deployment's gRPC load balancer
(``app``: the endpoints and their errors; ``protocol``: the schema; ``generation``: the calls to the
deployment). Run as ``python -m hcache.openai``; ``hcache serve --openai-port`` starts it. Kept light to
import: ``hcache serve`` reads the signals below without loading the server."""
import signal

DRAIN_SIGNAL, READY_SIGNAL = signal.SIGUSR1, signal.SIGUSR2
FINISH_S = 2.0  # after the drain and SIGTERM, the longest a request still running is waited for
