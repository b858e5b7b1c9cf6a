"""``python -m vd``: the ``vd`` command line (`vd.launch`, then `vd.cli`; nothing imports this module)."""

from vd.launch import main

main()
