# Sourced by the session GPU call scripts, on the device machine from the repo root:
# $OUT and has(), the carried binaries unpacked (.gpu/weft, .gpu/weftA, .gpu/tests/gpu,
# xz'd here to fit the carry), PyTorch's python as $PY, cuDNN on LD_LIBRARY_PATH, and the
# card's name in $GPU, and clocks_on NAME / clocks_off NAME around a run (the SM clock,
# power and clock event reasons sampled every 100 ms to $OUT/clk_NAME.csv, summed over its
# busy samples). Set PHASES before sourcing.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
has() { [[ " $PHASES " == *" $1 "* ]]; }
for f in .gpu/weft.xz .gpu/weftA.xz .gpu/tests/gpu.xz; do [ -f $f ] && xz -d -f $f; done
chmod +x .gpu/weft .gpu/weftA .gpu/tests/* 2>/dev/null
export PY=/opt/torch/.venv/bin/python3
CUDNN_LIB=$($PY -c 'import nvidia.cudnn; print(nvidia.cudnn.__path__[0] + "/lib")' 2>/dev/null); export LD_LIBRARY_PATH="$CUDNN_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
Q_FULL="utilization.gpu,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
Q_BASE="utilization.gpu,clocks.sm,power.draw,temperature.gpu"
Q=$Q_FULL; nvidia-smi --query-gpu=$Q --format=csv,noheader >/dev/null 2>&1 || Q=$Q_BASE
clocks_on() { nvidia-smi --query-gpu=$Q --format=csv,noheader,nounits -lms 100 > $OUT/clk_$1.csv 2>/dev/null & CLK=$!; }
# clocks_off sums the busy samples: mean SM clock and power, and how many had the SW
# power cap (0x4) or a thermal / HW slowdown (0x8, 0x20, 0x40, 0x80) among the active
# clock event reasons.
clocks_off() { kill $CLK 2>/dev/null; wait $CLK 2>/dev/null; $PY - $1 $OUT/clk_$1.csv <<'PYEOF'
import sys
rows = [l.strip().split(", ") for l in open(sys.argv[2]) if l.strip()]
busy = [r for r in rows if r[0].isdigit() and int(r[0]) >= 90]
if busy:
    n = len(busy); num = lambda i: [float(r[i]) for r in busy if r[i].replace(".", "").isdigit()]
    reasons = [int(r[4], 16) for r in busy if len(r) > 4 and r[4].startswith("0x")]
    cap = sum(1 for x in reasons if x & 0x4); slow = sum(1 for x in reasons if x & 0xE8)
    c, p, t = num(1), num(2), num(3)
    print(f"clocks {sys.argv[1]}: {n} busy samples, SM {sum(c)/max(len(c),1):.0f} MHz (min {min(c or [0]):.0f}), "
          f"{sum(p)/max(len(p),1):.0f} W, max {max(t or [0]):.0f} C, power cap in {cap}, thermal/HW slowdown in {slow} of {len(reasons)}")
PYEOF
}
