"""Worker of bench_launch's start-up measure: records when it began running, then exits."""

import os
import sys
import time

path = os.path.join(sys.argv[1], f"{os.environ['RANK']}.start")
with open(path + ".tmp", "w") as f:
    f.write(str(time.monotonic_ns()))
os.replace(path + ".tmp", path)
