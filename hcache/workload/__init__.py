"""Serving workloads: traces of chat and long-context sessions (``traces``), the servers a trace is replayed
against (``servers``: hcache's runtime or DeepSpeed-MII's pipeline) and the replay on a simulated clock
(``replay``). ``hcache bench workload`` compares methods with them."""
