# DAR against standard and Block AttnRes at a proxy of the DAR paper's sparse-MoE row ("a 7B sparse-MoE
# model"; its shape is not known to us. Ours, the shape of OLMoE-1B-7B with our GELU MLP: 24 layers,
# d=2048, 16 heads of 128, context 1024; in every layer 64 experts of width 1024 (4d / 8, the automatic
# width), top-8, no shared expert): 6.95B parameters, 1.31B active (6.85B and 1.21B without the tied
# embedding), counted by model.py on the meta device. Paired as config/dar_1b.py: 2.0B FineWeb-Edu
# tokens per run at 2^19 tokens/step (a comparison of arms under MoE, far from compute-optimal), 3 seeds.
#
# Memory per GPU, estimated (not measured; 8 x 80 GB, bf16 autocast, fp32 weights):
#   weights + gradients + AdamW moments, 16 B/parameter = 111 GB, sharded by FSDP over 8: 13.9 GB;
#   gathered units: one MoE layer's 64 experts (268M parameters, 1.1 GB fp32) and the next one
#   prefetched, their gradients before the reduce-scatter (1.1 GB), the root (embedding, norms,
#   routing: 0.4 GB); the grouped path's bf16 copy of a layer's experts (0.5 GB, and its gradient);
#   activations with checkpointing: each sublayer keeps its fp32 input (8 KB/token x 48 sublayers =
#   0.4 MB/token, 6.4 GB for a micro-batch of 16 x 1024 tokens), one recomputed MoE layer (8 routed
#   copies of each token: about 0.2 MB/token, 3.3 GB) and the logits (fp32 loss and gradient, about
#   6.6 GB): about 35 GB in all.
# Cost: 8.49 GFLOP/token (model.flops_per_token: active parameters) x 2.0B tokens = 1.70e19 FLOP per
# cell; checkpointing recomputes the forward (+1/3): about 2.26e19. At 40% MFU of an H100 (989 TFLOP/s
# bf16): 16 GPU-hours per cell (12 without checkpointing), 2 h on 8 GPUs; the grid (3 arms x 3 seeds)
# about 143 GPU-hours, before the AttnRes-family arms' overhead; MoE layers rarely reach a dense
# model's MFU (token sort and un-sort, 64 small matmuls per grouped GEMM), so budget more.
# $ python data/prepare.py --max_tokens=2.1e9
# $ torchrun --standalone --nproc_per_node=8 train.py config/dar_moe.py
import os

exec(open(os.path.join(os.path.dirname(__file__), "rd_120m.py")).read())
out_dir = "out/dar_moe"
arms = {"standard": {"residual": "standard"}, "attnres": {"residual": "attnres"}, "dar": {"residual": "dar"}}
seeds = [0, 1, 2]

n_layer = 24
n_head = 16
n_embd = 2048
attnres_block_size = 8  # 48 sublayers: 6 blocks of 8
n_experts = 64
moe_top_k = 8

# 16 sequences x 32 micro-steps x 1024 tokens = 2^19 tokens per step over all GPUs (4 micro-steps of 16 per GPU)
batch_size = 16
gradient_accumulation_steps = 32
learning_rate = 3e-4
min_lr = 3e-5

fsdp = True  # with AdamW (FSDP with Muon is refused)
activation_checkpointing = True
