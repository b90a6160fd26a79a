"""``asyncflow`` as the tests run it, forked from the session's real-stack fork server, its Ray forking its workers
from there too (``tests.zygote.launch_command``): the command line's Ray starts its workers through ``client.py``.

    python tests/zygote/client.py --script tests/zygote/launch.py train RECIPE [overrides...]
"""

import sys

from asyncflow.cli import main
from tests.zygote import forked_workers

if __name__ == "__main__":
    with forked_workers():
        sys.exit(main())
