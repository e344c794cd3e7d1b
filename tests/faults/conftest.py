"""The fault suite drives real jobs with the integration tests' helpers (launcher_util)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
