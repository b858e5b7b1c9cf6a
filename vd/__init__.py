"""vd: record-and-replay golden files for the logits of an LLM's speculative-decoding verify path.

This package is the core the recorder and the replayer share: the model protocol and its adapters
(`vd.protocol`, `vd.models`), the values a recording is made of (`vd.layout`, `vd.dtypes`), the one
verify step loop (`vd.loop`) and the checks beside it (`vd.coverage`), the golden store (`vd.store`),
row digests (`vd.digest`), the comparison (`vd.policy`, `vd.replayer.measure`, `vd.replayer.judge`) and environment
capture (`vd.env`). It never imports `vd.recorder`, `vd.replayer` or the command line (`vd.cli`) above it.
Importing it never initialises CUDA and sets no global torch flags.
"""

__version__ = "0.1.0"
