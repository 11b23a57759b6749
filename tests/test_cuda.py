"""
What only a GPU can show: compiled bf16 training steps with fused AdamW, the equivalences of
test_model.py on CUDA kernels, and DDP over NCCL. Skipped without CUDA (CI runs on CPU and counts
them as skipped); `python gpu_check.py` runs them with the rest of the GPU check.

    python -m pytest tests/test_cuda.py -q
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from data.shards import write_shard
from helpers import STARTS_AS_STANDARD, make, naive_depth_read, randomize_routing, rel_err, tokens, two_phase_read
from model import RESIDUALS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def exact_fp32():
    # TF32 matmuls would hide a 1e-5 difference; machine.setup turns them on for training
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("variant", list(RESIDUALS))  # a compile each: the registry's defaults, not every setting
def test_compiled_bf16_training_step(variant):
    model = make(variant)
    randomize_routing(model)
    model.cuda()
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cuda")
    assert optimizer.defaults["fused"]
    torch._dynamo.reset()
    compiled = torch.compile(model)
    idx = tokens().cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = compiled(idx, idx)
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.residual.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        grad_norm = p.grad.float().reshape(p.size(0), -1).norm(dim=1)
        live = [r for r in range(p.size(0)) if r not in model.residual.dead_rows().get(name, set())]
        assert all(grad_norm[r] > 0 for r in live), (name, grad_norm)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize("variant", STARTS_AS_STANDARD)
def test_zero_init_equals_standard_on_cuda(variant):
    standard = make("standard", seed=3, norm_eps=1e-10).cuda()
    model = make(variant, seed=4, norm_eps=1e-10)
    model.load_state_dict(standard.state_dict(), strict=False)
    idx = tokens().cuda()
    with torch.no_grad():
        assert rel_err(model.cuda()(idx, idx)[0], standard(idx, idx)[0]) < 1e-5


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_depth_read_equals_naive_on_cuda(dtype, tol):
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(2, 64, 128, generator=g).to("cuda", dtype).requires_grad_() for _ in range(5)]
    queries = torch.randn(2, 128, generator=g).to("cuda", dtype).requires_grad_()
    gain = (torch.rand(128, generator=g) + 0.5).to("cuda", dtype).requires_grad_()
    fast = two_phase_read(sources, queries, gain, 1e-6)
    slow = naive_depth_read(sources, queries, gain, 1e-6)
    for f, s in zip(fast, slow):
        assert f.dtype == dtype and (f.double() - s).abs().max() < tol * s.abs().max()
    weights = [torch.randn(2, 64, 128, generator=g).cuda().double() for _ in fast]
    inputs = sources + [queries, gain]
    grads_fast = torch.autograd.grad(sum((f.double() * w).sum() for f, w in zip(fast, weights)), inputs)
    grads_slow = torch.autograd.grad(sum((s * w).sum() for s, w in zip(slow, weights)), inputs)
    for gf, gs in zip(grads_fast, grads_slow):
        assert (gf.double() - gs).abs().max() < 5 * tol * gs.abs().max()


@pytest.mark.parametrize("variant", list(RESIDUALS))
def test_compile_fullgraph_matches_eager_on_cuda(variant):
    model = make(variant, n_layer=2)
    randomize_routing(model)
    model.cuda()
    idx = tokens().cuda()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        # fused kernels reduce in another order than eager: fp32 rounding, not 1e-5 of the cpu test
        assert rel_err(compiled(idx, idx)[0], model(idx, idx)[0]) < 1e-4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_torchrun_two_gpus_equals_one(tmp_path):
    stream = (np.arange(60_000) % 17 + np.random.default_rng(0).integers(0, 3, 60_000)).astype(np.uint16)
    write_shard(str(tmp_path / "val_000000.bin"), stream[:3000])
    write_shard(str(tmp_path / "train_000001.bin"), stream[3000:])
    args = [
        f"--data_dir={tmp_path}",
        "--n_layer=2",
        "--n_head=2",
        "--n_embd=32",
        "--block_size=16",
        "--vocab_size=64",
        "--batch_size=4",
        "--gradient_accumulation_steps=2",
        "--max_iters=6",
        "--eval_interval=3",
        "--eval_tokens=1000",
        "--compile=False",
        "--seeds=0",
        "--arms=rd_attnres",
        "--dtype=float32",
        "--device=cuda",
    ]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    subprocess.run([sys.executable, "train.py", *args, f"--out_dir={one}"], cwd=ROOT, check=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "train.py",
            *args,
            f"--out_dir={two}",
        ],
        cwd=ROOT,
        check=True,
    )
    losses = [
        [
            r["val_loss"]
            for r in map(json.loads, open(os.path.join(d, "rd_attnres", "seed0", "log.jsonl")))
            if "val_loss" in r
        ]
        for d in (one, two)
    ]
    assert np.allclose(losses[0], losses[1], rtol=1e-4)
