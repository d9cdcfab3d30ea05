"""Defaults that the command line shows, kept in a module that imports nothing heavy: building the parser
(``hcache --help``) must not import torch. The modules that use them re-export them."""

from __future__ import annotations

import os

DEFAULT_MODEL = "smollm2"  # the embedded SmolLM2-135M-Instruct (hcache.model.loader)
DEFAULT_READERS = min(8, os.cpu_count() or 1)  # reader threads of a host tier (hcache.storage.host_tier)
DEFAULT_LOAD_IN_STEP_TOKENS = 1024  # vLLM's connector: loads this small run in their request's step (hcache.config)
