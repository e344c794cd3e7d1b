"""The node side's unit tests share their doubles (launch_fakes.py) across the subfolders."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
