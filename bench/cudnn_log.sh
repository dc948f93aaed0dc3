#!/usr/bin/env bash
# cuDNN's API log of PyTorch's and Weft's attention graphs at the 1.24B model's shape
# (seq 4096, 32/8 heads, d 64, bf16, causal, [B, S, H, D]), to diff what each builds:
# PyTorch's backward runs ~15% faster than Weft's on the same libcudnn (session 20).
#   OUT=$OUT bash bench/cudnn_log.sh     (needs .gpu/weft from ../shared/gpu-pack)
PHASES=""
source bench/gpu_env.sh
export CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG=$OUT/torch_cudnn.log CUDNN_FRONTEND_LOG_INFO=1 CUDNN_FRONTEND_LOG_FILE=$OUT/torch_fe.log
timeout 60 $PY - <<'PY'
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
s = 4096
mk = lambda h: torch.randn(1, s, h, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
q, k, v = mk(32), mk(8), mk(8)
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    o.backward(torch.randn_like(o))
torch.cuda.synchronize()
print("torch done")
PY
export CUDNN_LOGDEST_DBG=$OUT/weft_cudnn.log
unset CUDNN_FRONTEND_LOG_INFO CUDNN_FRONTEND_LOG_FILE
timeout 90 ./.gpu/weft run llama3.2-1b --backend cuda --dtype bf16 --steps 1 --seq 4096 --batch 1 --torch-adamw --unfused-loss 2>&1 | grep -E "^mean|error"
ls -la $OUT
for f in $OUT/*.log; do echo "== $f: $(wc -l < $f) lines"; grep -ciE "engine|knob" $f; done
grep -iE "knob|engine_id|engineid|ENGINE_GLOBAL_INDEX" $OUT/torch_cudnn.log | sort | uniq -c | sort -rn | head -12
grep -iE "knob|engine_id|engineid|ENGINE_GLOBAL_INDEX" $OUT/weft_cudnn.log | sort | uniq -c | sort -rn | head -12
xz -T4 $OUT/*.log
exit 0
