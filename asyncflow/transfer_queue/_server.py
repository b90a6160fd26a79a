"""Process entry point of a controller or storage unit: ``python -m asyncflow.transfer_queue._server``.

The parent passes the config as JSON on stdin (never on the command line, where the secret would show
in ``ps``); a controller prints its address on stdout for the parent to read. Imports stay light
(no torch) so that a local deployment starts in a fraction of a second.
"""

from __future__ import annotations

import ctypes
import json
import signal
import sys
from dataclasses import fields

from .config import TransferQueueConfig


def config_from_dict(values: dict) -> TransferQueueConfig:
    names = {f.name for f in fields(TransferQueueConfig)}
    return TransferQueueConfig(**{k: v for k, v in values.items() if k in names})


def _die_with_parent() -> None:
    # Linux: get SIGTERM when the parent dies, so that a crashed test never leaves servers behind.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main() -> None:
    _die_with_parent()
    spec = json.loads(sys.stdin.readline())
    config = config_from_dict(spec["config"])
    if spec["role"] == "controller":
        from .controller import Controller

        server = Controller(config)
        print(server.address, flush=True)
    else:
        from .storage import StorageUnit

        # Units start in parallel with the controller; its address follows once it is known.
        controller = spec.get("controller") or sys.stdin.readline().strip()
        server = StorageUnit(spec["unit"], config, controller, spec.get("shm_prefix"))
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    # Ctrl-C in a terminal reaches the whole process group: the run that started this server decides when it
    # stops (it stops at a step boundary first, workflow.signals), then terminates it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server.serve_forever()


if __name__ == "__main__":
    main()
