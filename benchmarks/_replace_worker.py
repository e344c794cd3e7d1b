"""A worker for the replacement benchmark. Its first line stamps CLOCK_MONOTONIC (the system-wide
clock the benchmark kills by) into OUT/<rank>-<generation>.first; then it does what a training
script does first (import torch) and waits to be killed."""

import os, time  # noqa: E401, I001 - the first line of user code: nothing before the stamp

_t = time.monotonic_ns()
_out = os.environ["BENCH_OUT"]
_gen = int(os.environ.get("ELASTICRUN_REPLACEMENT", "0")) + int(
    os.environ["TORCHELASTIC_RESTART_COUNT"]
)
_tag = f"{os.environ['RANK']}-{_gen}"
with open(os.path.join(_out, f".{_tag}.first"), "w") as f:
    f.write(f"{_t} {os.getpid()}")
os.replace(os.path.join(_out, f".{_tag}.first"), os.path.join(_out, f"{_tag}.first"))

import torch  # noqa: E402

torch.ones(1).add_(1)
time.sleep(600)
