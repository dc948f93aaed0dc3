#!/usr/bin/env python3
"""Writes the programs of tests/filetests/*.weft (headers and input programs only).

Run once when adding a file; then `WEFT_BLESS=1 cargo test --test filetests` appends
the blessed output below `// expected:`. The programs are hand-written Llama-style
pieces (hidden 8, 2 heads of 4, vocabulary 16), small enough to read whole.
"""
import os

HEAD = '''%0: i64[B, S] = input {name="input_ids", role=input_ids}  # model
%1: i64[B, S] = input {name="labels", role=labels}  # loss
%2: f32[16, 8] = param {name="model.embed_tokens.weight"}  # model.embed_tokens
'''

LOSS = '''%{lm}: f32[B, S, 16] = linear %{x}, %{w}  # lm_head
%{sh}: i64[B, S] = shift_labels %1 {{ignore_index=-100}}  # loss
%{ce}: f32[] = cross_entropy %{lm}, %{sh} {{ignore_index=-100, reduction=sum}}  # loss
%{cnt}: f32[] = count_valid %{sh} {{ignore_index=-100}}  # loss
%{loss}: f32[] = div %{ce}, %{cnt}  # loss
return loss=%{loss}, logits=%{lm}
'''

def loss(x, w, first):
    n = dict(lm=first, sh=first + 1, ce=first + 2, cnt=first + 3, loss=first + 4, x=x, w=w)
    return LOSS.format(**n)

ATTN = HEAD + '''%3: f32[8] = param {name="model.layers.0.input_layernorm.weight"}  # model.layers.0.input_layernorm
%4: f32[8, 8] = param {name="model.layers.0.self_attn.q_proj.weight"}  # model.layers.0.self_attn.q_proj
%5: f32[8, 8] = param {name="model.layers.0.self_attn.k_proj.weight"}  # model.layers.0.self_attn.k_proj
%6: f32[8, 8] = param {name="model.layers.0.self_attn.v_proj.weight"}  # model.layers.0.self_attn.v_proj
%7: f32[8, 8] = param {name="model.layers.0.self_attn.o_proj.weight"}  # model.layers.0.self_attn.o_proj
%8: f32[16, 8] = param {name="lm_head.weight"}  # lm_head
%9: f32[B, S, 8] = embedding %0, %2  # model.embed_tokens
%10: i64[S] = arange {start=0}  # model.rotary_emb
%11: i64[1, S] = reshape %10 {shape=[1, S]}  # model.rotary_emb
%12: f32[1, S, 4], %13: f32[1, S, 4] = rope_table %11 {theta=10000.0, dim=4, scaling=none}  # model.rotary_emb
%14: f32[B, S, 8] = rms_norm %9, %3 {eps=1e-6}  # model.layers.0.input_layernorm
%15: f32[B, S, 8] = linear %14, %4  # model.layers.0.self_attn.q_proj
%16: f32[B, S, 8] = linear %14, %5  # model.layers.0.self_attn.k_proj
%17: f32[B, S, 8] = linear %14, %6  # model.layers.0.self_attn.v_proj
%18: f32[B, S, 2, 4] = reshape %15 {shape=[B, S, 2, 4]}  # model.layers.0.self_attn
%19: f32[B, S, 2, 4] = reshape %16 {shape=[B, S, 2, 4]}  # model.layers.0.self_attn
%20: f32[B, S, 2, 4] = reshape %17 {shape=[B, S, 2, 4]}  # model.layers.0.self_attn
%21: f32[B, 2, S, 4] = transpose %18 {dim0=1, dim1=2}  # model.layers.0.self_attn
%22: f32[B, 2, S, 4] = transpose %19 {dim0=1, dim1=2}  # model.layers.0.self_attn
%23: f32[B, 2, S, 4] = transpose %20 {dim0=1, dim1=2}  # model.layers.0.self_attn
%24: f32[B, 2, S, 4] = rope %21, %12, %13  # model.layers.0.self_attn
%25: f32[B, 2, S, 4] = rope %22, %12, %13  # model.layers.0.self_attn
%26: f32[B, 2, S, 4] = attention %24, %25, %23 {causal=true, scale=0.5}  # model.layers.0.self_attn
%27: f32[B, S, 2, 4] = transpose %26 {dim0=1, dim1=2}  # model.layers.0.self_attn
%28: f32[B, S, 8] = reshape %27 {shape=[B, S, 8]}  # model.layers.0.self_attn
%29: f32[B, S, 8] = linear %28, %7  # model.layers.0.self_attn.o_proj
%30: f32[B, S, 8] = add %9, %29  # model.layers.0
''' + loss(30, 8, 31)

# ATTN with k moved to [B, H, S, D] by a permute and v's transposed value also returned:
# `fuse` moves rope and attention to [B, S, H, D] and cancels the swaps around them, but
# keeps the transpose of v that the output still reads.
ATTN_BSHD = ATTN.replace(
    "%22: f32[B, 2, S, 4] = transpose %19 {dim0=1, dim1=2}",
    "%22: f32[B, 2, S, 4] = permute %19 {perm=[0, 2, 1, 3]}",
).replace("return loss=%35, logits=%31", "return loss=%35, logits=%31, v_heads=%23")

MLP = HEAD + '''%3: f32[8] = param {name="model.layers.0.post_attention_layernorm.weight"}  # model.layers.0.post_attention_layernorm
%4: f32[16, 8] = param {name="model.layers.0.mlp.gate_proj.weight"}  # model.layers.0.mlp.gate_proj
%5: f32[16, 8] = param {name="model.layers.0.mlp.up_proj.weight"}  # model.layers.0.mlp.up_proj
%6: f32[8, 16] = param {name="model.layers.0.mlp.down_proj.weight"}  # model.layers.0.mlp.down_proj
%7: f32[16, 8] = param {name="lm_head.weight"}  # lm_head
%8: f32[B, S, 8] = embedding %0, %2  # model.embed_tokens
%9: f32[B, S, 8] = rms_norm %8, %3 {eps=1e-6}  # model.layers.0.post_attention_layernorm
%10: f32[B, S, 16] = linear %9, %4  # model.layers.0.mlp.gate_proj
%11: f32[B, S, 16] = linear %9, %5  # model.layers.0.mlp.up_proj
%12: f32[B, S, 16] = silu %10  # model.layers.0.mlp
%13: f32[B, S, 16] = mul %12, %11  # model.layers.0.mlp
%14: f32[B, S, 8] = linear %13, %6  # model.layers.0.mlp.down_proj
%15: f32[B, S, 8] = add %8, %14  # model.layers.0
''' + loss(15, 7, 16)

MOE = HEAD + '''%3: f32[4, 8] = param {name="model.layers.0.mlp.gate.weight"}  # model.layers.0.mlp.gate
%4: f32[4, 16, 8] = param {name="model.layers.0.mlp.experts.gate_up_proj"}  # model.layers.0.mlp.experts
%5: f32[4, 8, 8] = param {name="model.layers.0.mlp.experts.down_proj"}  # model.layers.0.mlp.experts
%6: f32[16, 8] = param {name="lm_head.weight"}  # lm_head
%7: f32[B, S, 8] = embedding %0, %2  # model.embed_tokens
%8: f32[B*S, 8] = reshape %7 {shape=[B*S, 8]}  # model.layers.0.mlp
%9: f32[B*S, 4] = linear %8, %3  # model.layers.0.mlp.gate
%10: f32[B*S, 4] = softmax %9 {dim=-1}  # model.layers.0.mlp.gate
%11: f32[B*S, 2], %12: i64[B*S, 2] = topk %10 {k=2, dim=-1}  # model.layers.0.mlp.gate
%13: f32[B*S, 1] = sum %11 {dims=[-1], keepdim=true}  # model.layers.0.mlp.gate
%14: f32[B*S, 2] = div %11, %13  # model.layers.0.mlp.gate
%15: f32[2*B*S, 8], %16: i64[4], %17: i64[2*B*S] = moe_dispatch %8, %12 {num_experts=4}  # model.layers.0.mlp.experts
%18: f32[2*B*S, 16] = grouped_matmul %15, %4, %16  # model.layers.0.mlp.experts
%19: f32[2*B*S, 8], %20: f32[2*B*S, 8] = split %18 {dim=1, sizes=[8, 8]}  # model.layers.0.mlp.experts
%21: f32[2*B*S, 8] = silu %19  # model.layers.0.mlp.experts
%22: f32[2*B*S, 8] = mul %21, %20  # model.layers.0.mlp.experts
%23: f32[2*B*S, 8] = grouped_matmul %22, %5, %16  # model.layers.0.mlp.experts
%24: f32[B*S, 8] = moe_combine %23, %17, %14  # model.layers.0.mlp.experts
%25: f32[B, S, 8] = reshape %24 {shape=[B, S, 8]}  # model.layers.0.mlp
%26: f32[B, S, 8] = add %7, %25  # model.layers.0
''' + loss(26, 6, 27)

# Redundant layout ops a rewrite leaves behind: a transpose pair, a reshape chain and a
# duplicated linear (canonicalize's CSE), each an identity simplify/canonicalize remove.
LAYOUT = HEAD + '''%3: f32[16, 8] = param {name="lm_head.weight"}  # lm_head
%4: f32[B, S, 8] = embedding %0, %2  # model.embed_tokens
%5: f32[S, B, 8] = transpose %4 {dim0=0, dim1=1}  # model
%6: f32[B, S, 8] = transpose %5 {dim0=0, dim1=1}  # model
%7: f32[B*S, 8] = reshape %6 {shape=[B*S, 8]}  # model
%8: f32[B, S, 8] = reshape %7 {shape=[B, S, 8]}  # model
%9: f32[B, S, 8] = silu %8  # model
%10: f32[B, S, 8] = silu %8  # model
%11: f32[B, S, 8] = add %9, %10  # model
''' + loss(11, 3, 12)

# An SPMD program as a rewrite leaves it: elementwise ops after an all_gather, which
# simplify moves before it (each rank computes on its shard, not the whole).
GATHER = '''mesh sp=2
%0: f32[4, 8] = input {name="x", role=other}  # model
%1: f32[4*sp, 8] = all_gather %0 {axis="sp", dim=0}  # model
%2: f32[4*sp, 8] = add_scalar %1 {value=1.0}  # model
%3: f32[4*sp, 8] = pow_scalar %2 {exponent=2.0}  # model
%4: f32[] = sum %3 {dims=[0, 1], keepdim=false}  # loss
return loss=%4, y=%3
'''

FORWARD_SP = "shard-inputs, shard-seq, ulysses-attention, sp-loss, canonicalize"
FORWARD_DP = "shard-inputs, shard-seq, sp-loss, canonicalize"

FILES = [
    ("sp_ulysses", "attention on sp=2: inputs sliced by sequence, four all_to_alls trade heads for sequence around attention, the loss sum and count all-reduced", "sp=2", FORWARD_SP, None, "B=2 S=8", "attn", ATTN),
    ("dp_batch", "data parallel alone: each rank its batch block, no all_to_all, the loss reduced over dp", "dp=2", FORWARD_DP, None, "B=4 S=4", "attn", ATTN),
    ("tp_attention", "tensor parallel on tp=2: q/k/v column-parallel by heads, o_proj row-parallel with an all_reduce, the vocabulary-parallel loss", "tp=2", "tensor-parallel, canonicalize", None, "B=2 S=4", "attn", ATTN),
    ("tp_mlp", "tensor parallel SwiGLU: gate/up column-parallel, down row-parallel, one all_reduce", "tp=2", "tensor-parallel, canonicalize", None, "B=2 S=4", "mlp", MLP),
    ("ep_moe", "expert parallel on ep=2 (folded over dp=2): each rank its batch block and two of four experts, rows exchanged with all_to_all_v before and after the experts", "ep=2", "shard-inputs, shard-seq, sp-loss, expert-parallel, canonicalize", None, "B=4 S=4", "moe", MOE),
    ("fuse_attention_bshd", "fuse on an attention block's training step: rope, attention and attention_grad read and write [B, S, H, D] (layout=bshd), the transposes and the permute around them cancel, forward and backward; the transpose of v that an output reads stays", "", "autodiff, fuse", None, "B=2 S=4", "attn", ATTN_BSHD),
    ("autodiff_mlp", "autodiff of a SwiGLU block: a backward node per forward op, grad.<param> outputs", "", "autodiff", None, "B=2 S=4", "mlp", MLP),
    ("checkpoint_full", "full checkpointing: the layer's inside is recomputed before its backward, only its input is kept", "", "autodiff, checkpoint", "checkpoint=full", "B=2 S=4", "mlp", MLP),
    ("checkpoint_budget", "a checkpoint budget (min-cut): keep the step's live values within 4500 bytes (between recomputing nothing and the least, 4356): the min-cut recomputes the cheapest value; SGD frees each gradient at its update", "", "canonicalize, autodiff, checkpoint, grad-sync, optimizer", "checkpoint=budget=4500, optimizer=sgd:0.1, no_grad_outputs", "B=2 S=4", "mlp", MLP),
    ("offload", "activation offload: saved activations copied to the host after their forward use and back before the backward", "", "autodiff, offload", "offload", "B=2 S=4", "mlp", MLP),
    ("grad_sync_dp", "grad-sync on dp=2: the gradients' all_reduces coalesced into one bucket in backward order", "dp=2", FORWARD_DP + ", autodiff, grad-sync", "bucket_bytes=100000", "B=4 S=4", "mlp", MLP),
    ("zero2_sgd", "ZeRO-2 with SGD on dp=2: gradients reduce-scattered, each rank updates its shard, the updated parameters all-gathered", "dp=2", FORWARD_DP + ", autodiff, grad-sync, optimizer", "reduce_scatter, zero1, optimizer=sgd:0.1, bucket_bytes=100000", "B=4 S=4", "mlp", MLP),
    ("micro_batches", "two micro-batches: the batch split, each micro-batch's backward accumulates into one gradient", "dp=2", FORWARD_DP + ", micro-batches, autodiff, grad-sync", "micro_batches=2", "B=8 S=4", "mlp", MLP),
    ("simplify_collective", "simplify moves add_scalar and pow_scalar before an all_gather: each rank computes on its shard (the op table's unary class commutes with data movement)", "sp=2", "simplify, canonicalize", None, "", "gather", GATHER),
    ("simplify_layout", "simplify and canonicalize remove a transpose pair, a reshape chain and a duplicated op", "", "simplify, canonicalize", None, "B=2 S=4", "layout", LAYOUT),
]

here = os.path.dirname(os.path.abspath(__file__))
for name, what, mesh, passes, train, check, graph, body in FILES:
    lines = [f"// test: {what}"]
    if mesh:
        lines.append(f"// mesh: {mesh}")
    lines.append(f"// passes: {passes}")
    if train:
        lines.append(f"// train: {train}")
    if check is not None:
        lines.append(f"// check: {check}".rstrip())
    text = "\n".join(lines) + f'\ngraph "{graph}"\n' + body
    with open(os.path.join(here, name + ".weft"), "w") as f:
        f.write(text)
