"""hcache's OpenAI-compatible server: FastAPI and OpenAI's schema in front of a deployment's gRPC load balancer
(``app``: the endpoints and their errors; ``protocol``: the schema; ``generation``: the calls to the
deployment). Run as ``python -m hcache.openai``; ``hcache serve --openai-port`` starts it and signals it
(:mod:`hcache.mii.processes`)."""
