"""Benchmarks that measure hcache against its baselines side by side in one run, one per module, run by
``hcache bench <name>`` (:mod:`.command`)."""
