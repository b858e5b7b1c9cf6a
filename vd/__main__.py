"""``python -m vd``: the ``vd`` command line (`vd.cli`, the layer above this package; nothing imports
this module)."""

from vd.cli import main

main()
