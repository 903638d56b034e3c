"""posttrain: post-train language models with reinforcement learning.

The math lives in :mod:`posttrain.algos` (pure torch functions); everything else builds the
loop around it. Importing the package itself stays cheap: no transformers, ray or vllm here.
"""

__version__ = "0.1.0"
