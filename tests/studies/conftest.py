"""The studies beside the package (``studies/``) are imported from the repository root, as
``python -m studies.NAME`` runs them from a clone."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
