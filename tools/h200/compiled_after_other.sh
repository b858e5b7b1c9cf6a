# README's known limit, checked again: a compiled golden recorded by a process that had compiled another model of
# the same shapes first (tiny-llama reseeded, tests/plugins/reseeded.py), replayed in a fresh process; beside it
# the same golden recorded in a process of its own. Verdicts and notes on stdout, logs under $OUT.
. tools/h200/env.sh
export PYTHONPATH=$PYTHONPATH:$PWD
R=$PWD/tests/plugins/reseeded.py:factory
cd /tmp
for fwd in compiled compiled-graphed; do
  python3 - "$R" "$fwd" <<'P' > $OUT/after_other_$fwd.log 2>&1
import sys
from vd.recorder import RecordSettings, record
other, fwd = sys.argv[1], sys.argv[2]
s = dict(device="cuda", forward=fwd, steps=8, ks=(2, 3, 4))
record(f"/tmp/other-{fwd}.zarr", RecordSettings(model=other, **s))  # compiles the same shapes first
r = record(f"/tmp/after-{fwd}.zarr", RecordSettings(model="tiny-llama", **s))
print("recorded after another model:", r.location.url)
P
  python3 -m vd record /tmp/own-$fwd.zarr --model tiny-llama --device cuda --forward $fwd --steps 8 > $OUT/own_$fwd.log 2>&1
  for g in after own; do
    python3 -m vd replay /tmp/$g-$fwd.zarr > $OUT/replay_${g}_$fwd.log 2>&1
    echo "$fwd, recorded $g: replay exit $? $(grep -h 'note:' $OUT/replay_${g}_$fwd.log | head -2 | cut -c1-150)"
    grep -h "^  - " $OUT/replay_${g}_$fwd.log | head -4 | cut -c1-200
  done
  python3 -m vd diff /tmp/own-$fwd.zarr /tmp/after-$fwd.zarr > $OUT/diff_$fwd.log 2>&1; echo "$fwd: diff own after: exit $?"
done
