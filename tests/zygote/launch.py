"""``asyncflow`` as the tests run it in a subprocess whose Ray forks its workers from the session's fork server
(``tests.zygote``): the command line's Ray starts its workers through ``client.py``.

    python -m tests.zygote.launch train RECIPE [overrides...]
"""

import sys

from asyncflow.cli import main
from tests.zygote import forked_workers

if __name__ == "__main__":
    with forked_workers():
        sys.exit(main())
