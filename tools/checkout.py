"""Imported first by every script in tools/ that imports vd: puts the repository root at the front of
``sys.path``, so ``import vd`` is the checkout's vd (whose folders are its import paths), as ``python -m vd``
from the root sees it, installed or not. Scripts under tools/h200/ find this module through the PYTHONPATH
that tools/h200/env.sh sets."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path[:1] != [str(ROOT)]:
    sys.path.insert(0, str(ROOT))
