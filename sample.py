"""
Text from a trained cell, decoded with the tokenizer its data was made with (nanoGPT's sample.py).

$ python sample.py out/rd_attnres/seed0 --start="ROMEO:" --num_samples=3 --max_new_tokens=200
$ python sample.py out/attnres/seed1/ckpt.pt --start=FILE:prompt.txt --temperature=0.8 --top_k=40 --seed=2

The cell is a folder of train.py's out_dir (out/<arm>/seed<k>) or its ckpt.pt; the tokenizer is
that of the checkpoint's data_dir (data/shards.py's tokenizer_of). An empty --start begins a new
document (the end-of-text token). Each sample is printed whole, starting with --start.
"""

import math
import sys

import torch

import machine
from checkpoint import open_trained
from common import DataError, Parser, run


GREEDY_BELOW = 1e-20  # below it, draw the likeliest token (the limit at 0): logits / temperature would overflow


def main(argv):
    parser = Parser("sample.py", __doc__)
    parser.add_argument("cell", help="out_dir/<arm>/seed<k>, or its ckpt.pt")
    parser.add_argument(
        "--start", default="", help='the prompt, or FILE:path to read it from (default: a new document)'
    )
    parser.add_argument("--num_samples", type=int, default=3)
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help=f"> 0; lower is more predictable; below {GREEDY_BELOW:g}, greedy: the likeliest token",
    )
    parser.add_argument(
        "--top_k", type=int, default=None, help="sample from the k likeliest tokens only (default: all)"
    )
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument(
        "--device", default="auto", help="auto (cuda if there is one, else cpu), cpu, cuda, cuda:1, mps"
    )
    args = parser.parse_args(argv)
    for name, ok in (
        ("num_samples", args.num_samples >= 1),
        ("max_new_tokens", args.max_new_tokens >= 1),
        ("temperature", math.isfinite(args.temperature) and args.temperature > 0),
        ("top_k", args.top_k is None or args.top_k >= 1),
    ):
        if not ok:
            parser.error(f"--{name}={getattr(args, name)} must be {'> 0' if name == 'temperature' else '>= 1'}")
    if not 0 <= args.seed < 2**63:
        parser.error(f"--seed={args.seed} must be in [0, 2^63)")
    # auto as train.py resolves it (cuda, then mps, then cpu); any other name as torch takes it
    device = (
        machine.resolve_device("auto", 1, 0, torch.cuda.device_count(), torch.backends.mps.is_available())
        if args.device == "auto"
        else args.device
    )
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:  # an unknown name, or a device this torch cannot use
        parser.error(f"--device={args.device}: {str(e).splitlines()[0]}")
    if torch.device(device).type == "meta":  # accepted by torch, but its tensors hold no values to sample from
        parser.error(f"--device={args.device}: a meta device holds no values; use cpu or cuda")

    cell = open_trained(args.cell, device)
    model, tokenizer = cell.model, cell.tokenizer
    if cell.code_changes:  # the weights are the cell's, the code today's
        print(f"note: the code differs from the one the cell was trained with ({cell.changed()})", file=sys.stderr)
    start = args.start
    if start.startswith("FILE:"):
        try:
            with open(start[5:], encoding="utf-8") as f:
                start = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(
                f"--start={args.start}: cannot read {start[5:]} as UTF-8 text ({e.strerror if isinstance(e, OSError) else e.reason})"  # noqa: E501
            ) from None
    try:
        ids = tokenizer.encode(start).tolist() if start else [tokenizer.eot]
    except UnicodeEncodeError as e:  # a command line that is not UTF-8 arrives as lone surrogates
        raise DataError(f"--start is not text the tokenizer can encode (character {e.start}: {e.reason})") from None
    if max(ids) >= model.config.vocab_size:
        raise DataError(
            f"--start encodes to token id {max(ids)}, beyond the model's vocab_size {model.config.vocab_size}"
        )
    torch.manual_seed(args.seed)
    x = torch.tensor([ids], dtype=torch.long, device=device)
    # the limit of sampling as the temperature goes to 0: top_k=1 keeps the likeliest token (and its ties)
    temperature, top_k = (1.0, 1) if args.temperature < GREEDY_BELOW else (args.temperature, args.top_k)
    with torch.no_grad():
        for _ in range(args.num_samples):
            y = model.generate(x, args.max_new_tokens, temperature=temperature, top_k=top_k)
            print(start + tokenizer.decode(y[0, len(ids) :].tolist()))
            print("---------------")


if __name__ == "__main__":
    run(main)
