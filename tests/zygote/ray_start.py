"""Ray's command line with the node's workers forked from the tests' fork server (``tests.zygote``): the two-host
cluster's ``ray start`` on each host (``tests.zygote.two_host_options``). The server's socket and Ray's worker
script are in the environment the node is started with.

    python tests/zygote/ray_start.py start --block ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # started by path, from any folder

from ray.scripts.scripts import main  # noqa: E402

from tests.zygote import forked_workers  # noqa: E402

if __name__ == "__main__":
    with forked_workers():
        sys.exit(main())
