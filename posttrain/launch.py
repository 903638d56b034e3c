"""``posttrain rl|sft|rm|dpo --nproc-per-node N ...``: the command as N data-parallel processes on
this machine, as ``torchrun --standalone --nproc_per_node N -m posttrain ...`` starts them.

Why not only torchrun: when a rank stops on an error it has already explained (exit status 2,
one message), torchrun itself still ends in a Python traceback of its own (ChildFailedError),
which buries the message and reads as a crash of posttrain. Here the same launcher API runs the
ranks and a failure ends in the ranks' own messages and their exit status. Several machines are
still torchrun's (``--nnodes``, a rendezvous endpoint).
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Sequence


def launch(argv: Sequence[str], processes: int) -> int:
    """Run ``python -m posttrain *argv`` (without the launch option) as ``processes`` ranks here;
    their exit status (the first failed rank's: 2 for an error it explained, 143 when stopped by
    SIGTERM), or 0."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its lines repeat the ranks'
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=processes,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, as torchrun --standalone
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "posttrain", *argv)
    except ChildFailedError as failed:  # each failed rank printed its own message
        codes = [failure.exitcode for failure in failed.failures.values()]
        return next((code for code in codes if code > 0), 1)
    except SignalException as signalled:  # the launcher was sent SIGTERM: the ranks stopped (stopping.py)
        return 128 + int(signalled.sigval)
    return 0
