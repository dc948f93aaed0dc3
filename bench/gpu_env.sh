# Sourced by the session GPU call scripts, on the device machine from the repo root:
# $OUT and has(), the carried binaries unpacked (.gpu/weft, .gpu/weftA, .gpu/tests/gpu,
# xz'd here to fit the carry), PyTorch's python as $PY, cuDNN on LD_LIBRARY_PATH, and the
# card's name in $GPU. Set PHASES before sourcing.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
has() { [[ " $PHASES " == *" $1 "* ]]; }
for f in .gpu/weft.xz .gpu/weftA.xz .gpu/tests/gpu.xz; do [ -f $f ] && xz -d -f $f; done
chmod +x .gpu/weft .gpu/weftA .gpu/tests/* 2>/dev/null
export PY=/opt/torch/.venv/bin/python3
CUDNN_LIB=$($PY -c 'import nvidia.cudnn; print(nvidia.cudnn.__path__[0] + "/lib")' 2>/dev/null); export LD_LIBRARY_PATH="$CUDNN_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
