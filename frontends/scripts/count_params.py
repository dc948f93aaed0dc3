#!/usr/bin/env python3
"""Parameter count of each preset config as transformers reports it (meta device, no
weights): `/tmp/tv/bin/python frontends/scripts/count_params.py frontends/presets/NAME.json`.
The counts pinned in frontends/tests/presets.rs come from this script.
`quantization_config` is dropped (DeepSeek-V3's FP8 checkpoint format: the model's
parameters are the same, and transformers would otherwise ask for the FP8 kernels)."""
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
for p in sys.argv[1:]:
    cfg = AutoConfig.for_model(**{k: v for k, v in json.load(open(p)).items() if k not in ("architectures", "auto_map", "quantization_config")})
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    print(p, sum(t.numel() for t in m.parameters()))
