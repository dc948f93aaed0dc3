#!/usr/bin/env python3
"""Compiles the CUDA runtime's kernel source with NVRTC on a machine without a GPU, so a
syntax or type error in runtime/src/cuda/*.cu shows before a device call (NVRTC needs no
GPU to compile). Not part of the build or CI. Setup, in a throwaway virtualenv:

    python3 -m venv /tmp/nv && /tmp/nv/bin/pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12
    /tmp/nv/bin/python bench/nvrtc_check.py [--arch compute_90]

The files are concatenated in the order of `KERNEL_SOURCE` in runtime/src/cuda/device.rs.
Exit status 0 when the source compiles; the NVRTC log otherwise.
"""
import argparse
import ctypes
import glob
import os
import re
import sys

import nvidia.cuda_nvrtc
import nvidia.cuda_runtime

p = argparse.ArgumentParser()
p.add_argument("--arch", default="compute_90")
a = p.parse_args()
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
cuda = os.path.join(root, "runtime", "src", "cuda")
device_rs = open(os.path.join(cuda, "device.rs")).read()
block = device_rs[device_rs.index("pub const KERNEL_SOURCE"):]
block = block[: block.index(");")]
files = re.findall(r'include_str!\("([^"]+)"\)', block)
src = "\n".join(open(os.path.join(cuda, f)).read() for f in files).encode()
nvrtc_dir = nvidia.cuda_nvrtc.__path__[0]
lib = ctypes.CDLL(sorted(glob.glob(os.path.join(nvrtc_dir, "lib", "libnvrtc.so*")))[0])
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"weft.cu", 0, None, None) == 0
opts = [f"--gpu-architecture={a.arch}", "-std=c++17",
        "-I" + os.path.join(nvidia.cuda_runtime.__path__[0], "include"),
        "-I" + os.path.join(nvrtc_dir, "include")]
arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
lib.nvrtcGetProgramLog(prog, log)
print(log.value.decode(), end="")
print(f"{'ok' if rc == 0 else 'FAILED'}: {' + '.join(files)} ({len(src)} bytes) for {a.arch}")
sys.exit(0 if rc == 0 else 1)
