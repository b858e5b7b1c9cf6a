"""``python -m vd``: the ``vd`` command line (`vdcli`, the layer above this package; nothing imports
this module)."""

from vdcli import main

main()
