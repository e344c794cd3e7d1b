"""Run torchelastic 0.1's imagenet example as it ships (upstream/main.py), as a wrapper would:
its stand-ins on sys.path, a helper imported, the example run with runpy.

    elasticrun --standalone --nproc-per-node 2 benchmarks/example01/run.py \\
        --input_path TREE --model_arch resnet18
"""

import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "upstream", "main.py")
sys.path.insert(0, os.path.join(HERE, "standins"))

import harness  # noqa: E402 - after the stand-ins: what the example imports is theirs

harness.install()
sys.argv = [EXAMPLE, *sys.argv[1:]]
runpy.run_path(EXAMPLE, run_name="__main__")
harness.finish()
