"""Models and tokenizers: load local folders (``loading``), build tiny ones (``tiny``,
``tokenizers``), critics (``value``), reward scorers (``reward``), LoRA with a free reference
(``lora``), chat templates (``chat``) and chunked per-token log-probs (``logprobs``).

Import the submodules directly (``posttrain.models.tiny``, ...); this package file stays
empty so that ``import posttrain.models`` does not pull in transformers.
"""
