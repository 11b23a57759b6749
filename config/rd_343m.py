# RD-AttnRes against its Block AttnRes parent at the 343m size proxy (ours: 24 layers, d=1024,
# 16 heads, context 1024), paired over 5 seeds, 2.0B FineWeb-Edu tokens per run, 2^19 tokens/step.
# $ python data/prepare.py --max_tokens=2.1e9
# $ torchrun --standalone --nproc_per_node=8 train.py config/rd_343m.py
out_dir = "out/rd_343m"
data_dir = "data/fineweb_edu_sample-10BT"
arms = {"attnres": {"residual": "attnres"}, "rd_attnres": {"residual": "rd_attnres"}}
seeds = [0, 1, 2, 3, 4]

n_layer = 24
n_head = 16
n_embd = 1024
block_size = 1024
vocab_size = 50304  # GPT-2 tokens (FineWeb-Edu), padded to a multiple of 64
attnres_block_size = 6  # 24 layers: 8 blocks of 6 sublayers, about 9 sources per read

# 16 sequences x 32 micro-steps x 1024 tokens = 524,288 = 2^19 tokens per step, over all GPUs
batch_size = 16
gradient_accumulation_steps = 32
max_iters = 3815  # x 2^19 = 2.0B tokens
learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 250

eval_interval = 250
eval_tokens = 4_194_305  # 4,096 sequences spread over the 10,485,760-token validation shard (docs/protocol.md)
eval_batch_size = 16
