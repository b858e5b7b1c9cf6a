"""vd: record-and-replay golden files for the logits of an LLM's speculative-decoding verify path.

This package holds what the recorder and the replayer share: the model protocol and its adapters
(`vd.protocol`, `vd.models`), the one verify step loop (`vd.loop`), the zarr golden store (`vd.golden`),
row comparison (`vd.compare`), environment capture (`vd.env`) and the command line (`vd.cli`).
Importing it never initialises CUDA and sets no global torch flags.
"""

__version__ = "0.1.0"
