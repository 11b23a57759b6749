# DAR against standard, scaled_residual and Block AttnRes at a 1B proxy of the DAR paper's largest
# dense size (ours: 18 layers, d=2048, 16 heads of 128, context 1024; 1.009B parameters, 0.906B without the tied
# embedding, counted by model.py on the meta device; the paper's own shape is not known to us), paired
# as config/rd_120m.py: 2.0B FineWeb-Edu tokens per run at 2^19 tokens/step, so sizes compare at one
# budget (2 tokens per parameter: a comparison of arms, not a compute-optimal model). 3 seeds for cost.
#
# Memory per GPU, estimated (not measured; 8 x 80 GB, bf16 autocast, fp32 weights):
#   weights + gradients + AdamW moments, 16 B/parameter = 16.1 GB, sharded by FSDP over 8: 2.0 GB,
#   plus the gathered root (embedding, norms, routing: 0.41 GB) and one or two sublayers (0.13 GB each);
#   activations with checkpointing: each sublayer keeps its fp32 input (8 KB/token x 36 sublayers =
#   0.3 MB/token, 4.8 GB for a micro-batch of 16 x 1024 tokens) plus what the scheme's reads keep, plus
#   one recomputed layer (about 1.1 GB) and the logits (fp32 loss and its gradient, about 8 GB):
#   about 20 GB in all, so the micro-batch could grow. Without FSDP (DDP, e.g. for Muon) about 34 GB.
# Cost: 6.51 GFLOP/token (model.flops_per_token) x 2.0B tokens = 1.30e19 FLOP per cell; checkpointing
# recomputes the sublayers' forward (+1/3 of the matmuls): about 1.74e19. At 40% MFU of an H100
# (989 TFLOP/s bf16): 12 GPU-hours per cell (9 without checkpointing), 1.5 h on 8 GPUs; the grid
# (4 arms x 3 seeds) about 145 GPU-hours, before the AttnRes-family arms' own overhead.
# $ python data/prepare.py --max_tokens=2.1e9
# $ torchrun --standalone --nproc_per_node=8 train.py config/dar_1b.py
import os

exec(open(os.path.join(os.path.dirname(__file__), "rd_120m.py")).read())
out_dir = "out/dar_1b"
arms = {
    "standard": {"residual": "standard"},
    "scaled_residual": {"residual": "scaled_residual"},  # the strong baseline: learned residual scalars, embedding skip
    "attnres": {"residual": "attnres"},
    "dar": {"residual": "dar"},
}
seeds = [0, 1, 2]

n_layer = 18
n_head = 16
n_embd = 2048
attnres_block_size = 6  # 36 sublayers: 6 blocks of 6

# 16 sequences x 32 micro-steps x 1024 tokens = 2^19 tokens per step over all GPUs (4 micro-steps of 16 per GPU)
batch_size = 16
gradient_accumulation_steps = 32
learning_rate = 3e-4  # GPT-3's 1.3B used 2e-4; a little higher for the shorter run
min_lr = 3e-5

fsdp = True  # with AdamW (FSDP with Muon is refused)
activation_checkpointing = True
