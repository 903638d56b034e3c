"""Models and tokenizers: build tiny ones locally, compute per-token log-probs.

Import the submodules directly (``posttrain.models.tiny``, ...); this package file stays
empty so that ``import posttrain.models`` does not pull in transformers.
"""
