"""Errors a user causes and can act on.

Every such error derives from :class:`PosttrainError`; its message names the key, file, row,
checkpoint or function at fault and says what to do. The command line prints it as one
message and exits with status 2 (``--debug`` shows the traceback instead); anything else that
escapes is a bug in posttrain and keeps its traceback. The specific classes stay beside the
code that raises them (``ConfigError`` in ``config.py``, ``CheckpointError`` in
``run/checkpoint.py``, ...), so a caller can catch exactly the one it handles.
"""

from __future__ import annotations


class PosttrainError(Exception):
    """Base of every error whose message is written for the user."""


class MissingExtraError(PosttrainError, ImportError):
    """An optional package a feature needs is not installed; the message gives the install
    command (``pip install 'posttrain[vllm]'``, ...)."""


class TrainingDiverged(PosttrainError, RuntimeError):
    """The loss or the gradient became NaN/inf; the message says where and what to try. Raised
    by every training loop (offline and RL), so it lives here rather than in one of them."""
