"""The command line's options, each declared once as an ``Annotated`` type (typer's idiom), so a command's
signature reads as a list of what it takes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from vd.cli.common import (
    CONFIG_HELP,
    DEVICE_METAVAR,
    GOLDEN_OR_NAME,
    TOLERANCE_METAVAR,
    Dtype,
    Feed,
    Widths,
    parse_device,
    parse_head,
    parse_widths,
)

# -- shared by several commands
Config = Annotated[Path | None, typer.Option(metavar="FILE", help=CONFIG_HELP)]
Reason = Annotated[str | None, typer.Option(metavar="TEXT", help="Why: kept in the golden's history (a refresh of a "
                                            "suite needs one).")]
Summary = Annotated[Path | None, typer.Option(metavar="PATH", help="With --refresh: write the change summary "
                                              "(Markdown) here.")]
Tp = Annotated[int | None, typer.Option("--tp", metavar="N", min=1, help="Split the model over N ranks (tensor "
                                       "parallel, launched with torchrun; generated shapes). Default: a replay's or "
                                       "refresh's golden's own degree.")]
Suite = Annotated[bool, typer.Option("--suite", help="Work on the declared goldens (vd.toml, or the tool.vd table "
                                     "of pyproject.toml): those named, else all.")]
Tolerances = Annotated[list[str] | None, typer.Option("--tolerance", metavar=TOLERANCE_METAVAR, help="Repeatable: "
                                                      "KIND prefill, verify or draft; SPEC exact, ulp:N, "
                                                      "atol:X,rtol:Y, argmax, topk:N, kl:X; or decisions=margin:X "
                                                      "(argmax flips allowed below golden margin X).")]
AllowNonfinite = Annotated[bool, typer.Option("--allow-nonfinite", help="Store logits holding NaN or Inf "
                                              "(refused otherwise).")]
AllowThin = Annotated[bool, typer.Option("--allow-thin", help="Store a reference without both full and partial "
                                         "accepts (replay will fail it).")]
Deterministic = Annotated[bool, typer.Option("--deterministic", help="Use deterministic algorithms, a fixed cuBLAS "
                                             "workspace and no reduced-precision reductions (stored; replay "
                                             "applies them too).")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue the recording of OUT a crash cut short, from its "
                                      "journal (its settings; every step computed again is checked).")]

# -- vd record
RecordTargets = Annotated[list[str] | None, typer.Argument(metavar="OUT|NAME", help=f"Golden to write "
                                                            f"({GOLDEN_OR_NAME}); with --suite, declared goldens "
                                                            "(default: all).")]
RecordModel = Annotated[str, typer.Option(metavar="SPEC", help="Model: preset, checkpoint dir, .gguf, module:factory "
                                          "(`vd models`).")]
Prompt = Annotated[str | None, typer.Option(metavar="TEXT", help="Prompt (default: vd's own).")]
RecordWidths = Annotated[Widths, typer.Option("--k", metavar="K,K,...", parser=parse_widths, help="Verify widths.")]
Steps = Annotated[int, typer.Option(metavar="N", min=1, help="Verify steps per K.")]
RecordForward = Annotated[str | None, typer.Option(metavar="NAME", help="Forward to record with (default: the "
                                                   "model's; `vd forwards`).")]
FeedOpt = Annotated[Feed, typer.Option("--feed", help="reference: greedy drafts, one corrupted on odd steps; mtp: "
                                       "drafts from the model's MTP head.")]
RecordHead = Annotated[str | None, typer.Option(metavar="FILE", parser=parse_head, help="Attach this MTP head "
                                                "(.safetensors) to an HF model.")]
RecordDevice = Annotated[str, typer.Option(metavar=DEVICE_METAVAR, parser=parse_device, help="Device.")]
DtypeOpt = Annotated[Dtype, typer.Option("--dtype", help="Dtype the model computes in.")]
RecordThreads = Annotated[int | None, typer.Option(metavar="N", min=1, help="CPU threads (default: torch's).")]
Refresh = Annotated[bool, typer.Option("--refresh", help="Replace an existing golden.")]
RecordCoverage = Annotated[bool, typer.Option("--require-coverage", help="Refuse to store a golden unless every K has "
                                              "steps accepting each of 0..K-1 drafts.")]

# -- vd replay
ReplayTargets = Annotated[list[str] | None, typer.Argument(metavar="GOLDEN|NAME", help=f"Golden to replay "
                                                            f"({GOLDEN_OR_NAME}); with --suite, declared goldens "
                                                            "(default: all).")]
ReplayModel = Annotated[str | None, typer.Option(metavar="SPEC", help="Model (default: the golden's).")]
ReplayHead = Annotated[str | None, typer.Option(metavar="FILE", parser=parse_head, help="MTP head file to "
                                                "attach (default: the golden's).")]
DecodeForward = Annotated[str | None, typer.Option("--decode-forward", metavar="NAME", help="Compute the decode "
                                                   "rows each forward's verify rows are measured against with this "
                                                   "forward (default: the forward itself).")]
RecordDecodeForward = Annotated[str | None, typer.Option("--decode-forward", metavar="NAME", help="Compute the "
                                                       "decode rows (what the verify rows are measured against) "
                                                       "with this forward, as an engine that decodes with another "
                                                       "kernel than it verifies; every replay then does.")]
Batch = Annotated[int | None, typer.Option("--batch", metavar="N", help="Also run every step with the golden's "
                                           "sequence one member of a batch of N (others: other prompts, their own "
                                           "feeds), compared with the golden.")]
RecordBatch = Annotated[int | None, typer.Option("--batch", metavar="N", help="Record the sequence as one member of a "
                                                 "batch of N (others: other prompts, their own feeds); every replay "
                                                 "runs that batch again.")]
NoBatch = Annotated[bool, typer.Option("--no-batch", help="Record the sequence alone: a refresh of a golden recorded "
                                       "in a batch (or declared so) records it alone again.")]
Slot = Annotated[int | None, typer.Option("--slot", metavar="I", help="With --batch: the golden's sequence's slot "
                                          "(default: every slot in turn).")]
BatchSeed = Annotated[int | None, typer.Option("--batch-seed", metavar="S", help="With --batch: the seed of the other "
                                               "members' prompts (default 0).")]
RecordTrace = Annotated[bool, typer.Option("--trace/--no-trace", help="Also store each traced module's output digests "
                                           "and statistics at every step (vd locate then names the first module a "
                                           "replay's difference starts at); --no-trace: a refresh of a traced golden "
                                           "drops them.")]
Locate = Annotated[bool, typer.Option("--locate", help="Where a forward's rows differ, name the first module whose "
                                      "output differs from the golden's traces (a golden recorded with --trace).")]
ReplayVerify = Annotated[bool, typer.Option("--verify", help="Read every stored row first and check it against its "
                                            "digest and statistics (a replay otherwise reads only the rows whose "
                                            "digests differ).")]
ReplayForwards = Annotated[list[str] | None, typer.Option(metavar="NAME", help="Forward to replay; repeat for several "
                                                          "(default: the golden's).")]
ReportPath = Annotated[Path | None, typer.Option(metavar="PATH", help="Write the JSON report here.")]
ReplayWidths = Annotated[Widths | None, typer.Option("--k", metavar="K,K,...", parser=parse_widths,
                                                     help="Replay only these verify widths (default: all).")]
ReplayDevice = Annotated[str | None, typer.Option(metavar=DEVICE_METAVAR, parser=parse_device,
                                                  help="Device (default: the golden's).")]
ReplayThreads = Annotated[int | None, typer.Option(metavar="N", min=1, help="CPU threads (default: recorded).")]
AllowModelMismatch = Annotated[bool, typer.Option("--allow-model-mismatch", help="Compare even if the model's "
                                                  "fingerprint differs.")]
ReplayCoverage = Annotated[bool, typer.Option("--require-coverage", help="Fail unless every K has steps accepting "
                                              "each of 0..K-1 drafts.")]
Rows = Annotated[str | None, typer.Option(metavar="FULL", help="For a slim golden: the full golden it was made from, "
                                          "whose rows measure the rows that differ.")]
Bundle = Annotated[Path | None, typer.Option(metavar="DIR", help="On failure, write the first-divergence bundle here "
                                             "(default: REPORT's name + .bundle, when --report names a file).")]
Junit = Annotated[Path | None, typer.Option(metavar="PATH", help="Write JUnit XML here.")]
Html = Annotated[Path | None, typer.Option(metavar="PATH", help="Write a self-contained HTML page here.")]
SaveCandidate = Annotated[str | None, typer.Option(metavar="PATH", help="Keep the replayed forward's rows as a golden "
                                                   "here (with --suite, a folder: PATH/NAME.zarr); review with vd "
                                                   "diff, promote with vd refresh --from.")]
Shard = Annotated[str | None, typer.Option(metavar="I/N", help="With --suite: replay every N-th golden by name, from "
                                           "the I-th (1..N).")]

# -- vd forwards
ForwardsDevice = Annotated[str | None, typer.Option(metavar=DEVICE_METAVAR, parser=parse_device, help="Device "
                                                    "(default: cuda where this machine has it, else cpu).")]
