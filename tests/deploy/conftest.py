"""The deploy tests use the integration tests' helpers (launcher_util) and deploy/slurm's
local cluster (local_cluster), neither of which is a package."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "deploy" / "slurm"))
