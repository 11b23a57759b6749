"""
Mutation check: does the suite catch plausible one-line bugs? Each mutant below replaces one snippet
of a source file's code with a bug; the check copies the repository, applies one mutant at a time
and runs the test file that should catch it. A mutant is killed when that test file fails; each
test file must first pass on the unmutated copy. A snippet is matched on code, never comments (the
file is read with its comments left out), and on tokens, not layout (whitespace and a trailing comma
before a closing bracket are left out of both, so a snippet survives ruff format), and must occur
there exactly once: every snippet is
checked before anything runs, so a stale one stops the check with its number and file. The run
works on one copy of the checkout taken at its start; set OMP_NUM_THREADS=1 on a shared machine.

$ python dev/mutate.py --check         # only check the snippets (seconds)
$ python dev/mutate.py                 # every mutant (an hour on 2 cores busy with training runs)
$ python dev/mutate.py 3 7             # mutants 3 and 7 only
$ python dev/mutate.py --only=records  # the mutants whose file, test file or bug names this text
"""

import ast
import functools
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (file, original, mutant, test file, what the bug is), a row each: a table to scan (ruff format would spread a row
# over seven lines)
# fmt: off
MUTANTS = [
    # model.py
    ("model.py", "torch.cat([-x2, x1], dim=-1)", "torch.cat([x2, -x1], dim=-1)", "tests/test_model.py", "rotary embedding rotates the wrong way"),
    ("model.py", "torch.float32) / head_size)", "torch.float32) / (head_size // 2))", "tests/test_model.py", "rotary frequencies over half the head size"),
    ("model.py", "is_causal=True)", "is_causal=False)", "tests/test_model.py", "attention sees the future"),
    ("model.py", "* torch.rsqrt(key.to(acc).pow(2).mean(-1, keepdim=True) + eps) for key in keys]", "for key in keys]", "tests/test_model.py", "depth keys not RMS-normalised"),
    ("model.py", "gap = logit - read.lse", "gap = logit", "tests/test_model.py", "the partial sum joins a read without the sealed sources' normaliser"),
    ("model.py", "beta * (grad * (v - out)).sum(-1, keepdim=True)", "beta * (1 - beta) * (grad * (v - out)).sum(-1, keepdim=True)", "tests/test_model.py", "the merge's gradient through beta has its sigmoid derivative twice"),
    ("model.py", "if (k + 1) % self.block_size == 0:\n            return self.open_block(state.blocks + [partial], k + 1)", "if k % self.block_size == 0:\n            return self.open_block(state.blocks + [partial], k + 1)", "tests/test_model.py", "AttnRes blocks sealed one sublayer early"),
    ("model.py", "value_query = self.uniform(self.value_query[layer], f\"attn_v.{layer}\")", "value_query = self.uniform(self.query[k], f\"attn_v.{layer}\")", "tests/test_model.py", "RD's value route reads with the QK query"),
    ("model.py", "rho * p0 + (1 - rho) * p1 + beta[0] * out, (1 - rho) * p0 + rho * p1 + beta[1] * out", "rho * p0 + (1 - rho) * p1 + beta[1] * out, (1 - rho) * p0 + rho * p1 + beta[0] * out", "tests/test_model.py", "DAR write gates swapped between streams"),
    ("model.py", "return mix.transpose(-1, -2), post", "return mix, post", "tests/test_model.py", "HC stream mixing not transposed"),
    ("model.py", "std=0.02 / math.sqrt(2 * config.n_layer))", "std=0.02)", "tests/test_model.py", "residual projections without the scaled init"),
    ("model.py", "targets.reshape(-1), ignore_index=-1,", "targets.reshape(-1),", "tests/test_model.py", "ignored targets (-1) counted in the loss"),
    ("model.py", "beta = 2 * torch.sigmoid(self.write_gate[k])", "beta = 2 * torch.sigmoid(self.write_gate[k].mean(-1, keepdim=True))", "tests/test_model.py", "DAR's write gates scalar again (reciprocal keys = own keys per sublayer)"),
    ("model.py", "\"lr_scale\": self.config.routing_lr_scale}]", "\"lr_scale\": 1.0}]", "tests/test_model.py", "routing_lr_scale ignored"),
    ("model.py", "            x = (x_qk + x_v) / 2\n", "            x = x_qk\n", "tests/test_model.py", "rd_control='mix' reads the QK route only"),
    ("model.py", "write_gate = torch.stack([theta, -theta], dim=1)", "write_gate = torch.stack([theta, theta], dim=1)", "tests/test_model.py", "DAR's distinct start with equal gates, not antisymmetric (not standard at init)"),
    ("model.py", "x=lam * state.x + mu * state.embedding + out", "x=lam * state.x + mu * state.x + out", "tests/test_model.py", "scaled_residual's mu scales the stream, not the embedding skip h_0"),
    ("model.py", "self.residual_scale = nn.Parameter(torch.ones(self.n_sublayers))", "self.residual_scale = nn.Parameter(torch.zeros(self.n_sublayers))", "tests/test_model.py", "scaled_residual's lambda starts at 0 (the stream dropped at init)"),
    ("model.py", "nn.Parameter(torch.full((n_sublayers,), 3.0))", "nn.Parameter(torch.full((n_sublayers,), 0.0))", "tests/test_model.py", "DAR's rho starts at 1/2, not sigmoid(3) (still standard at init)"),
    ("model.py", "GROUPED_MM is not None and x.is_cuda and", "GROUPED_MM is not None and", "tests/test_moe.py", "the MoE grouped-matmul path taken on a CPU under bf16 autocast"),
    ("model.py", "MLP(config, config.moe_shared_experts * expert_hidden(config))", "MLP(config, expert_hidden(config))", "tests/test_moe.py", "moe_shared_experts=2 built at one expert's width"),
    # train.py, progress.py, checkpoint.py
    ("train.py", "return cell.learning_rate * (step + 1) / cell.warmup_iters", "return cell.learning_rate * step / cell.warmup_iters", "tests/test_train.py", "warmup starts at lr 0"),
    ("train.py", "return lo + 0.5 * (1.0 + math.cos(", "return lo + 0.5 * (1.0 - math.cos(", "tests/test_train.py", "cosine schedule runs backwards"),
    ("train.py", "share = x.size(0) / step_sequences", "share = 1 / len(batches)", "tests/test_train.py", "uneven micro-batches weighted equally"),
    ("train.py", "(loss * (share * runtime.world)).backward()", "(loss * share).backward()", "tests/test_train.py", "gradients under DDP scaled by 1/world"),
    ("train.py", "= loss[:len(rows)].double().sum(1)", "= loss[-len(rows):].double().sum(1)", "tests/test_train.py", "a short last evaluation batch scores its padding rows"),
    ("train.py", "np.random.default_rng([self.seed, self.epoch]).permutation(n)", "np.random.default_rng([self.seed, 0]).permutation(n)", "tests/test_train.py", "every epoch in the same order"),
    ("train.py", "if not math.isfinite(loss_avg):", "if False:", "tests/test_train.py", "a non-finite training loss does not stop the cell"),
    ("records.py", "n = (eval_tokens - 1) // T\n        if layout == \"first\":", "n = eval_tokens // T\n        if layout == \"first\":", "tests/test_train.py", "evaluation reads a sequence past eval_tokens when it is a multiple of block_size"),
    ("progress.py", "self.t_last += seconds", "pass", "tests/test_train.py", "evaluation time counted as training time"),
    ("progress.py", "if self.intervals > 1:", "if self.intervals > 0:", "tests/test_train.py", "time left counts the compiling first interval"),
    ("checkpoint.py", "torch.set_rng_state(state[\"torch\"].cpu())", "pass", "tests/test_checkpoint.py", "a resume does not restore the RNG (dropout masks differ from the uninterrupted run)"),
    # the loop as train_cell runs it (tests/test_loop.py): the two that would silently ruin every paper run first
    ("train.py", "step_sequences = s.gradient_accumulation_steps * s.batch_size", "step_sequences = s.batch_size", "tests/test_loop.py", "gradient_accumulation_steps ignored: a step trains on batch_size sequences"),
    ("train.py", "group[\"lr\"] = lr * group[\"lr_scale\"]", "group[\"lr\"] = lr", "tests/test_loop.py", "each optimizer group's lr_scale dropped in the loop (routing, MoE router and Muon rates never reach training)"),
    ("train.py", "loss_avg = loss_sum.item() / (state.step - state.step_last)", "loss_avg = loss_sum.item() / s.log_interval", "tests/test_loop.py", "a short last log interval averaged over a full one"),
    ("checkpoint.py", "state.changes = state.changes + ([", "state.changes = ([", "tests/test_loop.py", "a change accepted at one resume forgotten at the next"),
    ("cells.py", "torch.manual_seed(seed_for(seed, DROPOUT, runtime.rank))", "torch.manual_seed(seed_for(seed, DROPOUT))", "tests/test_loop.py", "every rank seeds dropout as rank 0"),
    # records.py
    ("records.py", "        if not is_routing(name):\n            h.update(name.encode())", "        if True:\n            h.update(name.encode())", "tests/test_train.py", "the init hash includes routing parameters (arms never pair)"),
    ("records.py", "eval_batch_size verify_shards allow_changes ", "eval_batch_size verify_shards allow_changes warmup_iters ", "tests/test_train.py", "a result key (warmup_iters) left out of the rerun check and the pairing"),
    ("grid_files.py", "if (record.get(\"arm\"), record.get(\"seed\")) != (arm, seed):", "if False:", "tests/test_records.py", "a copied cell folder counts as a new seed"),
    ("records.py", "downstream_bundle downstream_interval", "downstream_interval", "tests/test_downstream.py", "adding downstream_bundle to a finished grid refused as a change"),
    ("records.py", "node.body = node.body[1:] or [ast.Pass()]", "node.body = node.body", "tests/test_records.py", "a docstring edit is a code change (locks the grid)"),
    ("records.py", "message.args, message.keywords = [], []", "pass", "tests/test_records.py", "the fingerprint keeps messages (rewording an error locks the grid)"),
    ("records.py", "\"checkpoint.py\", \"data/shards.py\")", "\"data/shards.py\")", "tests/test_records.py", "checkpoint.py (what a resume restores) left out of the code fingerprint"),
    ("records.py", "if overriding and len(overriding) == len(arms):", "if False:", "tests/test_records.py", "a command-line model key every arm overrides is silently lost"),
    ("records.py", "return bool(owners) and residual not in owners", "return False", "tests/test_records.py", "a scheme option set for the run reaches every arm"),
    ("records.py", "create_json(self.path, self.merged())", "write_json(self.path, self.merged())", "tests/test_records.py", "a new grid's record not created exclusively (of two runs at once, one's arms lost)"),
    ("records.py", "todo += sorted(references.get(name, set()) & registered)", "pass", "tests/test_records.py", "a scheme's code misses the registered classes it derives from or calls (editing AttnRes never locks RD)"),
    ("records.py", "and (name not in registered or name in used)]", "]", "tests/test_records.py", "every scheme class is in every cell's code (adding or editing a scheme no arm trains locks every grid)"),
    # common.py, data/
    ("common.py", "json.dump(obj, f, indent=1, allow_nan=False)", "json.dump(obj, f, indent=1)", "tests/test_common.py", "write_json writes NaN (not strict JSON)"),
    ("common.py", "open(tmp, \"x\").close()", "open(tmp, \"w\").close()", "tests/test_common.py", "the temporary not created exclusively (a symlink planted at its name is followed)"),
    ("data/shards.py", "expected = HEADER_INTS * 4 + 2 * int(header[2])", "expected = HEADER_INTS * 4 + int(header[2])", "tests/test_prepare.py", "shard size checked in tokens, not bytes"),
    ("data/prepare.py", "if not groups and skip >= n:", "if skip >= n:", "tests/test_prepare.py", "resume skips later, smaller row groups"),
    ("data/prepare.py", "for part in (eot, d)]", "for part in (d, eot)]", "tests/test_prepare.py", "<|endoftext|> after each document instead of before"),
    ("data/prepare.py", "return file_index, row, int(pos - (ends[j] - lengths[j]))", "return file_index, row, int(pos - (ends[j] - lengths[j])) + 1", "tests/test_prepare.py", "resume position one token past a shard's end inside a document"),
    ("data/prepare.py", "if n_line[1].strip())", "if n_line[1])", "tests/test_prepare.py", "blank jsonl lines count as rows"),
    ("data/prepare.py", "            return file_index, row + 1, 0", "            return file_index, row, 0", "tests/test_prepare.py", "a shard cut at a tokenizer task's end records its last document as the next start"),
    ("data/prepare.py", "val_tokens = count(\"val_tokens\", val_tokens, most=MAX_SHARD)", "val_tokens = count(\"val_tokens\", val_tokens, least=-MAX_SHARD, most=MAX_SHARD)", "tests/test_prepare.py", "a negative val_tokens accepted (validation tokens copied into training)"),
    # paired_stats.py, report.py
    ("paired_stats.py", "std = float(np.ldexp(u.std(ddof=1), exponent))", "std = float(np.ldexp(u.std(ddof=0), exponent))", "tests/test_paired_stats.py", "population instead of sample standard deviation"),
    ("paired_stats.py", "wins, losses = int((d > 0).sum()), int((d < 0).sum())", "wins, losses = int((d > 0).sum()), int((d <= 0).sum())", "tests/test_paired_stats.py", "ties counted as wins"),
    ("paired_stats.py", "half = stats.t.ppf(0.975, n - 1) * u.std(ddof=1)", "half = stats.t.ppf(0.95, n - 1) * u.std(ddof=1)", "tests/test_paired_stats.py", "90% interval reported as 95%"),
    ("paired_stats.py", "return math.expm1(mean)", "return math.expm1(-mean)", "tests/test_paired_stats.py", "perplexity change with the wrong sign"),
    ("reporting/paired.py", "for k in sorted(set(ps) & set(qs))]", "for k in sorted(set(ps) & set(qs)) if k != \"learning_rate\"]", "tests/test_report.py", "a differing learning rate does not stop pairing"),
    ("reporting/paired.py", "d.std(0, ddof=1) / math.sqrt(n)", "d.std(0) / math.sqrt(n)", "tests/test_report.py", "delta curve's interval with the population std"),
    ("reporting/text.py", "return x if math.isfinite(x) else None", "return x", "tests/test_report.py", "paired.json holds NaN for a one-seed arm"),
    ("paired_stats.py", "critical = n - 1, stats.t.ppf(1 - ALPHA / 2, n - 1)", "critical = n - 1, stats.t.ppf(1 - ALPHA, n - 1)", "tests/test_paired_stats.py", "power of a one-sided test (critical t at 1 - alpha) reported as the two-sided one's"),
    ("paired_stats.py", "noncentrality = min(effect_in_sd * math.sqrt(n), 1e3)", "noncentrality = min(effect_in_sd, 1e3)", "tests/test_paired_stats.py", "power's noncentral parameter without sqrt(n) (seeds needed far too many)"),
    ("paired_stats.py", " + stats.nct.sf(critical, df, -noncentrality))", ")", "tests/test_paired_stats.py", "t_test_power loses its lower tail (power at no effect alpha / 2)"),
    ("reporting/downstream.py", "return dict(bundle_sha256=record[\"bundle_sha256\"],", "return dict(", "tests/test_report.py", "downstream results of different task bundles paired"),
    ("reporting/downstream.py", "scoring_code=record.get(\"scoring_code\"),", "", "tests/test_report.py", "downstream results scored by other code paired"),
    # machine.py, cells.py
    ("machine.py", "kind, index = \"cuda\" if cuda_count else \"mps\" if mps_available else \"cpu\", \"\"", "kind, index = \"mps\" if mps_available else \"cuda\" if cuda_count else \"cpu\", \"\"", "tests/test_machine.py", "device=auto picks MPS over a CUDA GPU"),
    ("machine.py", "torch.use_deterministic_algorithms(True)", "pass", "tests/test_machine.py", "deterministic CPU kernels never turned on"),
    ("cells.py", "model.load_state_dict(grid.init, strict=False)", "pass", "tests/test_train.py", "init_from accepted but every arm trained from its seed's init"),
    # downstream.py, tune.py, analyze.py
    ("downstream.py", "mean_loss = torch.where(scored, loss.float(), 0).sum(1) / scored.sum(1)", "mean_loss = torch.where(scored, loss.float(), 0).sum(1)", "tests/test_downstream.py", "multiple choice by summed loss, not mean (longer choices lose)"),
    ("downstream.py", "return [task.items[j + (j >= index)] for j in picks]", "return [task.items[j] for j in picks]", "tests/test_downstream.py", "an item's few-shot examples may include the item itself"),
    ("downstream.py", "return [(min(common_length(token_lists), len(with_continuation) - 1)", "return [(min(common_length(token_lists) + 1, len(with_continuation) - 1)", "tests/test_downstream.py", "a language-modelling item's first continuation token not scored (LM accuracy and CORE inflated)"),
    ("train.py", "cfg[\"downstream_max_per_task\"] or None)", "cfg[\"downstream_max_per_task\"])", "tests/test_downstream.py", "downstream_max_per_task=0 (every item) passed on as 0"),
    ("grid_files.py", "gain = safer[\"mean\"] - row[\"mean\"]", "gain = row[\"mean\"] - safer[\"mean\"]", "tests/test_tune.py", "a larger rate never beats a smaller one (the tuning takes the smallest rate that finished)"),
    ("analyze.py", "delta=nll - base,", "delta=base - nll,", "tests/test_analyze.py", "intervention deltas with the wrong sign"),
    # issue #41's review: the classes the shared grid, the tuned protocol and CORE added
    ("common.py", "if pid and (owner != host or not pid.isdigit() or process_exists(int(pid))):", "if pid and (not pid.isdigit() or process_exists(int(pid))):", "tests/test_common.py", "another host's lock taken over when its pid is not running here (two workers train one cell)"),
    ("train.py", "state.step % s.log_interval == 0) and stop_requested(runtime):", "state.step % s.log_interval == 0) and False:", "tests/test_cluster.py", "a stop signal never heeded in the loop (a preempted cell loses its work since the last checkpoint)"),
    ("paired_stats.py", "mean_square_interaction = (interaction ** 2).sum() / ((n - 1) * (m - 1))", "mean_square_interaction = (interaction ** 2).sum() / (n * m)", "tests/test_paired_stats.py", "the seed x text mean square over n m, not its degrees of freedom (n - 1)(m - 1)"),
    ("grid_files.py", "if gain > row[\"sd\"] else None", "if gain > 0 else None", "tests/test_tune.py", "a larger rate wins by any gain, inside its tuning seeds' noise"),
    ("grid_files.py", "if end is None or not end < starts[s]), None)", "if end is None), None)", "tests/test_tune.py", "a tuning seed that stalled at or above its step-0 loss counts as finished"),
    ("downstream.py", "random.Random(SHUFFLE_SEED).shuffle(items)", "pass", "tests/test_downstream.py", "max_per_task takes a file's first items, not nanochat's shuffled subset"),
    ("reporting/downstream.py", "dtype=record.get(\"dtype\"),", "", "tests/test_report.py", "downstream results scored in other precisions paired"),
    # the field's schemes (issue #50): each against its plain-loop reference in tests/test_zoo.py
    ("model.py", "self.norm_weight[k], self.eps)", "self.norm_weight[0], self.eps)", "tests/test_zoo.py", "postnorm: every sublayer normalised by the first sublayer's norm weight"),
    ("model.py", 'alpha, beta = self.output_weight[k], self.skip_weight[k]\n        self.note(f"laurel_weights/{self.name_of(k)}", lambda: torch.stack([alpha, beta]).expand(*out.shape[:-1], 2))\n        return alpha * out + beta * x', "alpha, beta = self.output_weight[k], self.skip_weight[k]\n        return beta * out + alpha * x", "tests/test_zoo.py", "laurel_rw: the output and skip weights swapped"),
    ("model.py", "return out + x + self.low_rank(x, k)", "return out + x + self.low_rank(out, k)", "tests/test_zoo.py", "laurel_lr: the low-rank skip of the sublayer's output, not of its input"),
    ("model.py", "self.skip_weight[k] * (x + self.low_rank(x, k))", "self.skip_weight[k] * x + self.low_rank(x, k)", "tests/test_zoo.py", "laurel (RW+LR): beta weighs the identity skip only, not the low-rank term"),
    ("model.py", "torch.einsum(\"btji,btjd->btid\", R, state.H)", "torch.einsum(\"btij,btjd->btid\", R, state.H)", "tests/test_zoo.py", "frac: the read weights transposed (input i takes fraction i's row)"),
    ("model.py", "return state._replace(r=state.r + out)\n        layer = layer_of(k)\n        outputs = state.outputs", "return state._replace(r=state.q + out)\n        layer = layer_of(k)\n        outputs = state.outputs", "tests/test_zoo.py", "muddformer: the attention's output joins the query input, not the residual one"),
    # issue #52: a lock of this very pid (a restart), the report's inputs and a report.lock this host cannot check
    ("common.py", "if (pid, owner) == (str(os.getpid()), host) and os.path.abspath(path) not in held_locks:", "if False:", "tests/test_common.py", "a lock of this process's own pid (a container restart) held forever: the worker leaves the cell to itself"),
    ("grid_files.py", "for name in (\"result.json\", \"downstream.json\")]", "for name in (\"result.json\",)]", "tests/test_train.py", "a downstream.json newer than the report leaves the report up to date"),
    ("grid_files.py", "[os.path.join(out_dir, \"config.json\"), choice_path(out_dir)]", "[os.path.join(out_dir, \"config.json\")]", "tests/test_train.py", "the report kept up to date after the tuning chose again"),
    ("cells.py", "if e.alive:", "if True:", "tests/test_train.py", "another host's report.lock: the grid ends without a report, exit 0, no line"),
    # issue #52: export's --out= (an unset variable) and the exported model's survivors
    ("export.py", "if not out.strip():", "if False:", "tests/test_export.py", "--out= empty: the export replaces the working directory, or is written into its parent"),
    ("modeling_nanodepth.py", "logits[:, :-1].float().reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1)", "logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1)", "tests/test_export.py", "the exported model's loss with labels= unshifted (each token scored on predicting itself)"),
    ("modeling_nanodepth.py", "self.max_position_embeddings = self.gpt.get(\"block_size\", GPTConfig.block_size)", "self.max_position_embeddings = 1024", "tests/test_export.py", "max_position_embeddings fixed at 1024 whatever the cell's block_size (lm-eval reads it)"),
    # issue #52: the survivors of the report and the tuning, and the cases fixed beside them (#50's verdict)
    ("grid_files.py", "if not any(beats(r, row) for r in usable[i + 1:]))", "if not any(beats(r, row) for r in usable[i + 1:i + 2]))", "tests/test_tune.py", "a rate compared with the next larger one only (a larger rate that beats a worse middle one never chosen)"),
    ("grid_files.py", "winner = next(r for r in usable if r[\"learning_rate\"] > safer[\"learning_rate\"] and beats(r, safer))", "winner = best", "tests/test_tune.py", "the reason credits the chosen rate with a win over the next smaller one that a larger rate made"),
    ("reporting/grid.py", "there = (by_reference.get(reference) or {}).get(\"arms\") or {}", "there = (next(iter(by_reference.values())) or {}).get(\"arms\") or {}", "tests/test_report.py", "--beside shows the other grid's first reference's numbers in every reference's rows"),
    ("reporting/grid.py", "arm_differ={} if unrecorded else arm_differences(configs, arms))", "arm_differ={})", "tests/test_report.py", "--beside never compares per-arm settings (two methods under one arm name: 'nothing')"),
    ("tune.py", "check_recorded(os.path.join(tune_dir, \"choice.json\"), recorded, record)", "None", "tests/test_tune.py", "a hand-edited choice.json silently rewritten"),
    ("grid_files.py", "if key in UNORDERED_KEYS and isinstance(value, list):", "if False:", "tests/test_tune.py", "the same tuning rates in another order refused as other settings"),
    ("reporting/text.py", "        return \"undefined\"\n    return format(", "        return \"nan\"\n    return format(", "tests/test_report.py", "statistics of 0 or 1 paired seeds printed as nan"),
    ("paired_stats.py", "identical = bool((d == d.flat[0]).all())", "identical = False", "tests/test_paired_stats.py", "identical deltas give a zero-width interval over seeds and text"),
    ("reporting/paired.py", "half = np.where((d == d[:1]).all(0), np.nan, half)", "half = half", "tests/test_report.py", "the delta curve draws a zero-width band where every seed has the same delta"),
    ("paired_stats.py", "text[\"n\"] >= BOOTSTRAP_CALIBRATED_SEEDS:", "text[\"n\"] >= 2:", "tests/test_paired_stats.py", "the bootstrap quoted as the verdict's interval at too few seeds to be calibrated"),
    # launch.py (issue #51, and #52's launcher survivors): the warning and the requeue limit, what --status reads
    ("launch.py", "for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):", "for sig in (signal.SIGTERM, signal.SIGUSR1):", "tests/test_cluster.py", "SIGUSR2 (the time limit's warning, sent to every process of the job) kills train.py before its checkpoint"),
    ("launch.py", "ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=MAX_TIME_LIMITS)", "ex = submitit.SlurmExecutor(folder=folder)", "tests/test_cluster.py", "submitit's requeue limit back to its default 3: a worker ends on its 4th time limit"),
    ("grid_files.py", "if pid and (host != socket.gethostname() or not pid.isdigit() or process_exists(int(pid))):", "if pid and (not pid.isdigit() or process_exists(int(pid))):", "tests/test_cluster.py", "--status blind to another host's lock (shown pending)"),
    ("launch.py", "    for g in grids(cfg):\n        for arm, seed in grid_cells(g):", "    for g in grids(cfg)[-1:]:\n        for arm, seed in grid_cells(g):", "tests/test_cluster.py", "--status blind to the tuning cells and their hours"),
    ("launch.py", "left_s = sum(n * rate.get(arm, seconds / steps) for arm, n in left)", "left_s = sum(n * seconds / steps for arm, n in left)", "tests/test_cluster.py", "--status's time left at every arm's rate, blind to a slower arm's"),
    ("launch.py", "f\"--jobs={','.join(job_ids)}\"", "f\"--jobs={job_ids[0]}\"", "tests/test_cluster.py", "squeue asked about the first array only"),
    # issue #53: a definition that computes nothing (where the data is, when the report is written) locks no grid
    ("records.py", "sorted((set(before) | set(now)) - NOT_COMPUTING)", "sorted(set(before) | set(now))", "tests/test_records.py", "fixing write_report or moving find_data refuses every rerun of every grid"),
    # an unchanged tuning choice rewritten on every run, so every rerun of a tuned grid writes its report again
    ("tune.py", "if recorded != json.loads(json.dumps(record)):", "if True:", "tests/test_tune.py", "an unchanged choice.json rewritten: its newer file makes every rerun write the report again"),
    # the paper recipes and the routing rate (issue #65)
    ("model.py", "r = x + self.norm(r, self.post_norm[layer])", "r = self.norm(r, self.post_norm[layer])", "tests/test_zoo.py", "muddformer_paper: the residual way loses the layer's output (PostDANorm replaces instead of adds)"),
    ("model.py", "return self.sinkhorn_rows_first(logits + self.bias_res[k]).transpose(-1, -2), post", "return self.sinkhorn_rows_first(logits + self.bias_res[k]), post", "tests/test_zoo.py", "mhc_paper: res[j, i] read as stream i into stream j"),
    ("model.py", "/ math.sqrt(self.RANK * d)", "/ math.sqrt(d)", "tests/test_zoo.py", "laurel_lr_paper: A at 1/sqrt(d), r times the paper's init"),
    ("grid_files.py", "learning_rate=rate * scale", "learning_rate=scale", "tests/test_tune.py", "routing scales ordered and recorded by scale, not by the routing rate"),
    ("tune.py", 'seeds=recorded["seeds"] + [s for s in record["seeds"] if s not in recorded["seeds"]],', 'seeds=record["seeds"],', "tests/test_tune.py", "a rerun of fewer compared seeds shrinks choice.json's seeds"),
    ("tune.py", "| ({\"routing_lr_scale\": routing_scale[arm]} if routing_scale.get(arm, 1) != 1 else {})", "", "tests/test_tune.py", "the chosen routing scale never reaches the paired grid's arm"),
    # bad input round seven (issue #66)
    ("records.py", 'typed = typed if "residual" in typed else {"residual": arm} | typed', "typed = typed", "tests/test_records.py", "an arm named after a scheme in a config's arm dict trains the run's residual (standard)"),
    ("launch.py", "own[key] = [*own[key], text]", 'own[key] = [*own[key], *text.split(",")]', "tests/test_cluster.py", "a --setup line (or --sbatch value) split at its commas"),
    ("progress.py", "timed, self.untimed = steps - self.untimed, 0", "timed, self.untimed = steps, 0", "tests/test_progress.py", "a resumed interval's step time divides this process's time by steps an earlier process trained"),
    ("grid_files.py", "if routing[0].get(arm) != held:", "if False:", "tests/test_tune.py", "the report trusts an edited routing table in choice.json"),
    # pairing on the code each cell records, and the compile cache of the routed schemes (2026-12-07)
    ("reporting/paired.py", "pairing = lambda a, s: pairing_record(results[a, s])", 'pairing = lambda a, s: results[a, s]["pairing"]', "tests/test_report.py", "the report pairs on each cell's stored digest: declaring a definition non-computing unpairs every stored cell"),
    ("grid_files.py", 'digest(set(code["definitions"]) - registered - NOT_COMPUTING)', 'digest(set(code["definitions"]) - registered)', "tests/test_report.py", "the fingerprint a cell pairs on counts the definitions that compute nothing"),
    ("machine.py", "torch._inductor.config.unsafe_marked_cacheable_functions.update(marked)", "pass", "tests/test_train.py", "every compiled cell of a routed scheme traces its graphs again: the compile cache refuses them"),
]
# fmt: on


def without_comments(source):
    """source with its comments left out (a comment's whole line where it is alone on it), and for
    each character kept, its offset in source: a mutant applied there keeps everything else."""
    lines = io.StringIO(source).readlines()
    line_start = [0]
    for line in lines:
        line_start.append(line_start[-1] + len(line))
    cuts = []  # (start, end) offsets of each comment, with the spaces before it
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            line, before = line_start[row - 1], lines[row - 1][:col]
            if before.strip():
                cuts.append((line + len(before.rstrip()), line + col + len(token.string)))
            else:
                cuts.append((line, line_start[row]))
    code, offsets, kept_from = [], [], 0
    for start, end in cuts + [(len(source), len(source))]:
        code.append(source[kept_from:start])
        offsets.extend(range(kept_from, start))
        kept_from = end
    return layout_free("".join(code), offsets)


def layout_free(code, offsets=None):
    """code without whitespace and without a comma right before a closing bracket, and each kept
    character's offset: what ruff format may change is left out of the match (of a snippet, too)."""
    offsets = range(len(code)) if offsets is None else offsets
    kept = [(c, o) for c, o in zip(code, offsets) if not c.isspace()]
    kept = [(c, o) for i, (c, o) in enumerate(kept) if not (c == "," and i + 1 < len(kept) and kept[i + 1][0] in ")]}")]
    return "".join(c for c, _ in kept), [o for _, o in kept]


@functools.cache
def read_code(path):
    """A file's source, its code (without_comments) with offsets, and its syntax tree dumped."""
    with open(path) as f:
        source = f.read()
    return source, *without_comments(source), ast.dump(ast.parse(source))


def mutated_source(index, root=ROOT):
    """The mutant's file under root with its snippet replaced, or a line saying why it cannot be."""
    path, original, mutant, test_file, what = MUTANTS[index]
    where = f"mutant {index} ({path}: {what})"
    missing = [name for name in (path, test_file) if not os.path.exists(os.path.join(root, name))]
    if missing:
        return None, f"{where}: {missing[0]} does not exist"
    try:
        source, code, offsets, tree = read_code(os.path.join(root, path))
    except (tokenize.TokenError, SyntaxError) as e:
        return None, f"{where}: {path} is not valid Python ({e})"
    lead, trail = len(original) - len(original.lstrip()), len(original) - len(original.rstrip())
    original = layout_free(original)[0]
    count = code.count(original)
    if count != 1:
        return None, (
            f"{where}: its snippet is in the code {count} times, not once; make it the code as it is "
            f"now (comments left out), long enough to be unique:\n    {original!r}"
        )
    i = code.index(original)
    start, end = offsets[i], offsets[i + len(original) - 1] + 1
    # the whitespace a snippet begins or ends with is replaced too (a mutant that drops a line drops its indent)
    while lead and start and source[start - 1].isspace():
        start, lead = start - 1, lead - 1
    while trail and end < len(source) and source[end].isspace():
        end, trail = end + 1, trail - 1
    changed = source[:start] + mutant + source[end:]
    try:
        if ast.dump(ast.parse(changed)) == tree:
            return None, f"{where}: the mutant does not change the code"
    except SyntaxError as e:
        return None, f"{where}: the mutant is not valid Python ({e}); a bug the import catches proves nothing"
    return changed, None


def check_all(root=ROOT):
    """Every mutant's snippet matched once and its mutant valid, or exit naming each one that is not."""
    problems = [problem for i in range(len(MUTANTS)) if (problem := mutated_source(i, root)[1])]
    if problems:
        sys.exit("error: " + "\nerror: ".join(problems))


def failing_test(work, test_file):
    """None when the test file passes in work, else pytest's line naming the first failure."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-x", "-q", "-p", "no:cacheprovider"],
        cwd=work,
        capture_output=True,
        text=True,
    )
    if proc.returncode == 0:
        return None
    lines = proc.stdout.splitlines()
    return next((line for line in lines if line.startswith(("FAILED", "ERROR"))), (lines or ["no output"])[-1])


def copy_of(folder, work):
    shutil.copytree(
        folder, work, ignore=shutil.ignore_patterns(".git", ".venv", "out*", "__pycache__", "*_gpt2", "gpu_check")
    )
    return work


def run_mutant(index, snapshot, tmp):
    work = copy_of(snapshot, os.path.join(tmp, f"m{index}"))
    with open(os.path.join(work, MUTANTS[index][0]), "w") as f:
        f.write(mutated_source(index, snapshot)[0])
    survived = failing_test(work, MUTANTS[index][3]) is None
    shutil.rmtree(work)
    return "survived" if survived else "killed"


def chosen_mutants(argv):
    """Mutant numbers from argv: numbers, --only=TEXT (in the file, test file or bug), or all."""
    only = [a.split("=", 1)[1] for a in argv if a.startswith("--only=")]
    numbers = [a for a in argv if not a.startswith("--")]
    unknown = [a for a in argv if a.startswith("--") and a != "--check" and not a.startswith("--only=")]
    if unknown or not all(a.isdigit() and int(a) < len(MUTANTS) for a in numbers):
        sys.exit(f"error: usage: python dev/mutate.py [--check] [--only=TEXT] [N ...] with N below {len(MUTANTS)}")
    named = [
        i
        for i, (path, _, _, test_file, what) in enumerate(MUTANTS)
        if any(t in f"{path} {test_file} {what}" for t in only)
    ]
    if only and not named:
        sys.exit(f"error: no mutant's file, test file or bug names {' or '.join(only)}")
    return sorted({int(a) for a in numbers} | set(named)) if numbers or only else list(range(len(MUTANTS)))


def main(argv):
    chosen = chosen_mutants(argv)
    check_all()
    print(f"{len(MUTANTS)} mutants, each snippet in its file's code once", flush=True)
    if "--check" in argv:
        return
    t0, outcome = time.time(), {}
    with tempfile.TemporaryDirectory() as tmp:
        # one copy of the checkout for the whole run, so edits made meanwhile do not mix in
        snapshot = copy_of(ROOT, os.path.join(tmp, "snapshot"))
        check_all(snapshot)
        broken = {}  # a mutant is only killed by tests that pass without it
        for test_file in sorted({MUTANTS[i][3] for i in chosen}):
            work = copy_of(snapshot, os.path.join(tmp, "baseline"))
            if failure := failing_test(work, test_file):
                broken[test_file] = failure
                print(
                    f"error: {test_file} fails on the unmutated code ({failure}); its mutants are not run", flush=True
                )
            shutil.rmtree(work)
        for i in chosen:
            path, _, _, test_file, what = MUTANTS[i]
            outcome[i] = "untested" if test_file in broken else run_mutant(i, snapshot, tmp)
            print(f"{i:>3} {outcome[i]:<9} {path}: {what} ({test_file})", flush=True)
    counts = {o: sum(v == o for v in outcome.values()) for o in ("killed", "survived", "untested")}
    minutes, seconds = divmod(int(time.time() - t0), 60)
    print(
        f"{counts['killed']} of {len(outcome)} mutants killed, {counts['survived']} survived, "
        f"{counts['untested']} untested ({minutes}m{seconds:02d}s)"
    )
    sys.exit(0 if counts["killed"] == len(outcome) else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
