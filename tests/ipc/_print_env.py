"""A child for tests/ipc/test_plumbing.py: writes its PYTHONPATH, $X and whether it leads its
own session to the file named by its argument."""

import json
import os
import sys

with open(sys.argv[1], "w") as f:
    json.dump([os.environ["PYTHONPATH"], os.environ.get("X"), os.getsid(0) == os.getpid()], f)
