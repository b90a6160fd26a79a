"""A world of one picks its own rendezvous port; when another process takes that port before the store listens
(two runs starting at once on one machine), it picks another instead of failing the run."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

CHILD = """
import os, socket
for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
    os.environ.pop(key, None)
import asyncflow.models.parallel as parallel
taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
ports = [taken.getsockname()[1]]  # the first pick is a port another process already listens on
real = parallel.free_port
def pick(host="127.0.0.1"):
    port = ports.pop() if ports else real(host)
    picked.append(port)
    return port
picked = []
parallel.free_port = pick
parallel.init_megatron(1, 1, 0)
import torch
assert torch.distributed.get_world_size() == 1 and len(picked) == 2, picked
print("ok", picked)
"""


def test_a_world_of_one_picks_another_port_when_its_port_was_taken():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stdout[-2000:] + out.stderr[-3000:]
