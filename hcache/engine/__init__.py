"""Inference engines hcache restores into. ``reference`` runs anywhere torch runs (HF transformers modules).

Nothing is imported here: ``hcache prepare`` lives in this package, and ``hcache --help`` must not import
torch."""
