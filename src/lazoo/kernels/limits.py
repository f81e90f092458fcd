"""What each Triton kernel takes, stated once. The kernel modules check their inputs against these limits, and the
ops read them to decide whether the Triton path can run a case without importing Triton: this module imports torch
only (an exported model folder, which has no kernels, carries a copy of it for the ops)."""

from __future__ import annotations

import torch

#: the input dtypes the kernels take (fp16 and bf16 inputs are computed in fp32 inside)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# ---- lazoo.kernels.delta: the chunked delta rule (also VLA's S update)
#: largest head dim (dk and dv)
DELTA_MAX_HEAD_DIM = 256
#: the chunk sizes the kernels are built for
DELTA_CHUNK_SIZES = (16, 32, 64)
#: largest dk of the backward on a GPU for float32 inputs: its reverse state walk holds a chunk's q, k and W~ rows
#: whole, and at dk = 256 that takes 238 340 bytes of shared memory at its smallest blocks (sm_90, Triton 3.6), over
#: a block's 232 448
DELTA_FP32_BACKWARD_MAX_HEAD_DIM = 128

# ---- lazoo.kernels.delta_step: a (Gated) DeltaNet layer's decode step in one kernel
#: largest head dim (dk and dv: a value head's whole state [dv, dk] is held in registers)
DELTA_STEP_MAX_HEAD_DIM = 128

# ---- lazoo.kernels.decode_linear: a decode step's input products in one launch each
#: the rows (batch × new tokens) they take: one block of rows, so that every weight is read once
DECODE_LINEAR_MAX_ROWS = 64
#: the weights one launch of ``linear_many`` takes
DECODE_LINEAR_MAX_WEIGHTS = 8

# ---- lazoo.kernels.mamba2_step: a Mamba-2 layer's decode step
#: largest state size N (a program holds whole rows of a head's state [P, N]; the head dim P is split into blocks)
MAMBA2_STEP_MAX_STATE_SIZE = 256

# ---- lazoo.kernels.kda: Kimi Delta Attention (the delta rule with a decay per key dim)
#: largest head dim (dk and dv: a chunk's whole key rows are held in registers); the smallest is 16 (tl.dot)
KDA_MAX_HEAD_DIM = 128

# ---- lazoo.kernels.linear (linear attention, its gated form; RLS's memory part) and lazoo.kernels.gla
#: largest head dim (the backward holds a whole dk row of a chunk)
LINEAR_MAX_HEAD_DIM = 256
#: largest head dim (dk and dv) of GLA's kernels
GLA_MAX_HEAD_DIM = 256

# ---- lazoo.kernels.local_linear
#: largest head dims (q/k and v)
LOCAL_LINEAR_MAX_HEAD_DIM = 128
#: largest number of slope features (r×r moments per query live in registers)
LOCAL_LINEAR_MAX_RANK = 32

# ---- lazoo.kernels.ovq: the chunk attention (attention) and the slot assignments (assign)
#: largest head dim (q/k tiles and the [BM, dv] accumulator are held whole)
OVQ_MAX_HEAD_DIM = 128
#: largest chunk size and head dim of the assignments (a chunk's keys and L×L matrices are held in registers)
OVQ_ASSIGN_MAX_CHUNK = 128
OVQ_ASSIGN_MAX_HEAD_DIM = 128

# ---- lazoo.kernels.rls
#: largest head dim: the dk×dk inverse lives in registers
RLS_MAX_HEAD_DIM = 128
#: rows of a sub-block (the pivot blocks of the sweep and the positions solved at once); a chunk is a multiple of it
RLS_BLOCK = 16

# ---- lazoo.kernels.ttt
#: largest head dim (dk and dv)
TTT_MAX_HEAD_DIM = 256
#: largest mini-batch (one mini-batch is one tile)
TTT_MAX_MINI_BATCH = 128

# ---- lazoo.kernels.vla: the A scans (token, chunk)
#: largest head dim (A is held whole in registers)
VLA_MAX_HEAD_DIM = 128

# ---- lazoo.kernels.short_conv
#: widest convolution (taps unrolled at compile time)
SHORT_CONV_MAX_KERNEL_SIZE = 8

# ---- lazoo.kernels.rms_norm: the RMSNorm (zero-centred or not, optionally with a SiLU gate)
#: largest normalised dim (a program holds whole rows in registers)
RMS_NORM_MAX_DIM = 16384

# ---- lazoo.kernels.gates: a Gated DeltaNet layer's g and β
#: most heads (a program holds whole rows of heads)
GATES_MAX_HEADS = 1024
