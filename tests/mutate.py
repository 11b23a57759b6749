"""
Mutation check: does the suite catch plausible one-line bugs? Each mutant below replaces one exact
snippet of a source file (it must occur exactly once); the check copies the repository, applies
one mutant at a time and runs the test file that should catch it. A mutant is killed when that
test file fails; each test file must first pass on the unmutated copy.

$ python tests/mutate.py              # every mutant (about 10 minutes on 2 idle cores)
$ python tests/mutate.py 3 7          # mutants 3 and 7 only
"""

import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (file, original, mutant, test file, what the bug is)
MUTANTS = [
    # model.py
    ("model.py", "torch.cat([-x2, x1], dim=-1)", "torch.cat([x2, -x1], dim=-1)",
     "tests/test_model.py", "rotary embedding rotates the wrong way"),
    ("model.py", "torch.float32) / head_size)", "torch.float32) / (head_size // 2))",
     "tests/test_model.py", "rotary frequencies over half the head size"),
    ("model.py", "is_causal=True)", "is_causal=False)", "tests/test_model.py", "attention sees the future"),
    ("model.py", "* torch.rsqrt(key.to(acc).pow(2).mean(-1, keepdim=True) + eps) for key in keys]",
     "for key in keys]", "tests/test_model.py", "depth keys not RMS-normalised"),
    ("model.py", "gap = logit - read.lse", "gap = logit", "tests/test_model.py",
     "the partial sum joins a read without the sealed sources' normaliser"),
    ("model.py", "beta * (grad * (v - out)).sum(-1, keepdim=True)",
     "beta * (1 - beta) * (grad * (v - out)).sum(-1, keepdim=True)", "tests/test_model.py",
     "the merge's gradient through beta has its sigmoid derivative twice"),
    ("model.py", "if (k + 1) % self.block_size == 0:  # the block is sealed",
     "if k % self.block_size == 0:  # the block is sealed",
     "tests/test_model.py", "AttnRes blocks sealed one sublayer early"),
    ("model.py", "value_query = self.uniform(self.value_query[layer], f\"attn_v.{layer}\")",
     "value_query = self.uniform(self.query[k], f\"attn_v.{layer}\")", "tests/test_model.py",
     "RD's value route reads with the QK query"),
    ("model.py", "rho * p0 + (1 - rho) * p1 + beta[0] * out, (1 - rho) * p0 + rho * p1 + beta[1] * out",
     "rho * p0 + (1 - rho) * p1 + beta[1] * out, (1 - rho) * p0 + rho * p1 + beta[0] * out",
     "tests/test_model.py", "DAR write gates swapped between streams"),
    ("model.py", "return mix.transpose(-1, -2), post", "return mix, post", "tests/test_model.py",
     "HC stream mixing not transposed"),
    ("model.py", "std=0.02 / math.sqrt(2 * config.n_layer))", "std=0.02)", "tests/test_model.py",
     "residual projections without the scaled init"),
    ("model.py", "targets.reshape(-1), ignore_index=-1,", "targets.reshape(-1),", "tests/test_model.py",
     "ignored targets (-1) counted in the loss"),
    ("model.py", "beta = 2 * torch.sigmoid(self.write_gate[k])", "beta = 2 * torch.sigmoid(self.write_gate[k].mean(-1, keepdim=True))",
     "tests/test_model.py", "DAR's write gates scalar again (reciprocal keys = own keys per sublayer)"),
    ("model.py", "\"lr_scale\": self.config.routing_lr_scale}]", "\"lr_scale\": 1.0}]", "tests/test_model.py",
     "routing_lr_scale ignored"),
    ("model.py", "            x = (x_qk + x_v) / 2\n", "            x = x_qk\n", "tests/test_model.py",
     "rd_control='mix' reads the QK route only"),
    # train.py
    ("train.py", "return cfg[\"learning_rate\"] * (step + 1) / cfg[\"warmup_iters\"]",
     "return cfg[\"learning_rate\"] * step / cfg[\"warmup_iters\"]", "tests/test_train.py", "warmup starts at lr 0"),
    ("train.py", "return lo + 0.5 * (1.0 + math.cos(", "return lo + 0.5 * (1.0 - math.cos(", "tests/test_train.py",
     "cosine schedule runs backwards"),
    ("train.py", "share = x.size(0) / step_sequences", "share = 1 / len(batches)", "tests/test_train.py",
     "uneven micro-batches weighted equally"),
    ("train.py", "(loss * (share * ctx[\"world\"])).backward()", "(loss * share).backward()", "tests/test_train.py",
     "gradients under DDP scaled by 1/world"),
    ("train.py", "total += torch.stack([loss.double(), (y != -1).sum().double()])",
     "total += torch.stack([loss.double(), torch.tensor(float(y.numel()), dtype=torch.float64, device=y.device)])",
     "tests/test_train.py", "evaluation counts padded tokens"),
    ("train.py", "np.random.default_rng([self.seed, self.epoch]).permutation(n)",
     "np.random.default_rng([self.seed, 0]).permutation(n)", "tests/test_train.py", "every epoch in the same order"),
    ("train.py", "if not math.isfinite(loss_avg):", "if False:", "tests/test_train.py",
     "a non-finite training loss does not stop the cell"),
    ("train.py", "n_seq = (cfg[\"eval_tokens\"] - 1) // T", "n_seq = cfg[\"eval_tokens\"] // T", "tests/test_train.py",
     "evaluation reads a sequence past eval_tokens when it is a multiple of block_size"),
    ("train.py", "t_last += time.time() - t_eval  # evaluation time is not training time", "pass",
     "tests/test_train.py", "evaluation time counted as training time"),
    # bookkeeping.py
    ("bookkeeping.py", "        if not name.startswith(\"residual.\"):\n            h.update(name.encode())",
     "        if True:\n            h.update(name.encode())", "tests/test_train.py",
     "the init hash includes routing parameters (arms never pair)"),
    ("bookkeeping.py", "\"eval_batch_size\", \"verify_shards\", \"allow_changes\",",
     "\"eval_batch_size\", \"verify_shards\", \"allow_changes\", \"warmup_iters\",", "tests/test_train.py",
     "a result key (warmup_iters) left out of the rerun check and the pairing"),
    ("bookkeeping.py", "if recorded is not None and (recorded.get(\"arm\"), recorded.get(\"seed\")) != (arm, seed):",
     "if False:", "tests/test_train.py", "a copied cell folder counts as a new seed"),
    ("bookkeeping.py", "if self.intervals > 1:", "if self.intervals > 0:", "tests/test_bookkeeping.py",
     "time left counts the compiling first interval"),
    ("bookkeeping.py", "node.body = body[1:] or [ast.Pass()]", "node.body = body", "tests/test_bookkeeping.py",
     "a docstring edit is a code change (locks the grid)"),
    ("bookkeeping.py", "if overriding and len(overriding) == len(arms):", "if False:", "tests/test_bookkeeping.py",
     "a command-line model key every arm overrides is silently lost"),
    ("bookkeeping.py", "return bool(owners) and residual not in owners", "return False", "tests/test_bookkeeping.py",
     "a scheme option set for the run reaches every arm"),
    # data/prepare.py
    ("data/prepare.py", "if not groups and skip >= n:", "if skip >= n:", "tests/test_prepare.py",
     "resume skips later, smaller row groups"),
    ("data/prepare.py", "for part in (eot, d)]", "for part in (d, eot)]", "tests/test_prepare.py",
     "<|endoftext|> after each document instead of before"),
    ("data/prepare.py", "expected = HEADER_INTS * 4 + 2 * int(header[2])", "expected = HEADER_INTS * 4 + int(header[2])",
     "tests/test_prepare.py", "shard size checked in tokens, not bytes"),
    ("data/prepare.py", "return file_index, row, int(pos - (ends[j] - lengths[j]))",
     "return file_index, row, int(pos - (ends[j] - lengths[j])) + 1", "tests/test_prepare.py",
     "resume position one token past a shard's end inside a document"),
    ("data/prepare.py", "if n_line[1].strip())", "if n_line[1])", "tests/test_prepare.py", "blank jsonl lines count as rows"),
    ("data/prepare.py", "            return file_index, row + 1, 0", "            return file_index, row, 0", "tests/test_prepare.py",
     "a shard cut at a tokenizer task's end records its last document as the next start"),
    ("data/prepare.py", "json.dump(obj, f, indent=1, allow_nan=False)", "json.dump(obj, f, indent=1)", "tests/test_prepare.py",
     "write_json writes NaN (not strict JSON)"),
    # report.py
    ("report.py", "std = float(d.std(ddof=1))", "std = float(d.std(ddof=0))", "tests/test_report.py",
     "population instead of sample standard deviation"),
    ("report.py", "wins, losses = int((d < 0).sum())", "wins, losses = int((d <= 0).sum())", "tests/test_report.py",
     "ties counted as wins"),
    ("report.py", "half = stats.t.ppf(0.975, n - 1) * std", "half = stats.t.ppf(0.95, n - 1) * std", "tests/test_report.py",
     "90% interval reported as 95%"),
    ("report.py", "ppl_change=math.exp(mean) - 1", "ppl_change=math.exp(-mean) - 1", "tests/test_report.py",
     "perplexity change with the wrong sign"),
    ("report.py", "for k in sorted(set(ps) & set(qs))]", "for k in sorted(set(ps) & set(qs)) if k != \"learning_rate\"]",
     "tests/test_report.py", "a differing learning rate does not stop pairing"),
    ("report.py", "d.std(0, ddof=1) / math.sqrt(n)", "d.std(0) / math.sqrt(n)", "tests/test_report.py",
     "delta curve's interval with the population std"),
    ("report.py", "return x if math.isfinite(x) else None", "return x", "tests/test_report.py",
     "paired.json holds NaN for a one-seed arm"),
    # analyze.py
    ("analyze.py", "delta=nll - base,", "delta=base - nll,", "tests/test_analyze.py",
     "intervention deltas with the wrong sign"),
]


def run_tests(work, test_file):
    proc = subprocess.run([sys.executable, "-m", "pytest", test_file, "-x", "-q", "-p", "no:cacheprovider"],
                          cwd=work, capture_output=True, text=True)
    return proc.returncode == 0


def copy_of_repository(tmp, name):
    work = os.path.join(tmp, name)
    shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(".git", ".venv", "out*", "__pycache__", "*_gpt2", "gpu_check"))
    return work


def run_mutant(index, tmp):
    path, original, mutant, test_file, what = MUTANTS[index]
    source = open(os.path.join(ROOT, path)).read()
    if source.count(original) != 1:
        return "stale"  # the code moved on: fix the mutant's snippet
    work = copy_of_repository(tmp, f"m{index}")
    with open(os.path.join(work, path), "w") as f:
        f.write(source.replace(original, mutant))
    passed = run_tests(work, test_file)
    shutil.rmtree(work)
    return "survived" if passed else "killed"


def main(argv):
    chosen = [int(a) for a in argv] or range(len(MUTANTS))
    outcome = {}
    with tempfile.TemporaryDirectory() as tmp:
        # a mutant is only killed by tests that pass without it
        for test_file in sorted({MUTANTS[i][3] for i in chosen}):
            if not run_tests(copy_of_repository(tmp, "baseline"), test_file):
                sys.exit(f"error: {test_file} fails on the unmutated code; fix that first")
            shutil.rmtree(os.path.join(tmp, "baseline"))
        for i in chosen:
            outcome[i] = run_mutant(i, tmp)
            path, _, _, test_file, what = MUTANTS[i]
            print(f"{i:>3} {outcome[i]:<9} {path}: {what} ({test_file})", flush=True)
    killed = sum(o == "killed" for o in outcome.values())
    counted = sum(o != "stale" for o in outcome.values())
    print(f"{killed} of {counted} mutants killed" + (f", {counted - killed} survived" if counted > killed else ""))
    sys.exit(0 if killed == counted and counted == len(outcome) else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
