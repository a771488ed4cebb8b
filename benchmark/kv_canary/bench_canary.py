"""tok/s with the KV canary off vs on (raise mode, every forward checked), EAGLE spec v2,
measured in one run and printed side by side.

    python benchmark/kv_canary/bench_canary.py --preset toy --topk 1,16 --batch-sizes 1,16,48

A toy target makes the canary's fixed per-forward cost look as large as it can: the ratio it
prints is an upper bound for models whose forward does real work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from specpatch import engine as eng  # noqa: E402
from specpatch import synth  # noqa: E402

SHAPES = {1: eng.SpecConfig(1, 3, 4), 16: eng.SpecConfig(16, 3, 32)}


def measure(target, draft, spec, mode: str, batch_sizes, max_new_tokens, vocab, repeats) -> list[dict]:
    os.environ["SGLANG_KV_CANARY"] = mode  # read by the scheduler process at start-up
    rows = []
    with eng.engine(**eng.engine_kwargs(target, draft, spec, max_running_requests=max(batch_sizes))) as e:
        for bs in batch_sizes:
            prompts = eng.random_prompts(bs, vocab, seed=bs)
            eng.generate(e, prompts, 16)
            best = max((eng.generate(e, prompts, max_new_tokens) for _ in range(repeats)), key=lambda r: r.tok_per_s)
            rows.append({"topk": spec.topk, "canary": mode, "bs": bs, "tok_per_s": best.tok_per_s})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="toy")
    parser.add_argument("--topk", default="1,16")
    parser.add_argument("--batch-sizes", default="1,16,48")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models")
    parser.add_argument("--out")
    args = parser.parse_args()

    root = Path(args.models or tempfile.mkdtemp()) / f"{args.preset}-a0.7"
    if not (root / "draft" / synth.META).exists():
        synth.make_pair(root, args.preset, 0.7, device="cuda")
    target, draft = root / "target", root / "draft"
    vocab = synth.load_meta(target)["spec"]["vocab"]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for topk in (int(k) for k in args.topk.split(",")):
        for mode in ("off", "raise"):
            rows += measure(target, draft, SHAPES[topk], mode, batch_sizes, args.max_new_tokens, vocab, args.repeats)

    print(f"{'topk':>4} {'bs':>4} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7}")
    for off in (r for r in rows if r["canary"] == "off"):
        on = next(r for r in rows if r["canary"] == "raise" and r["topk"] == off["topk"] and r["bs"] == off["bs"])
        off["on_over_off"] = on["tok_per_s"] / off["tok_per_s"]
        print(f"{off['topk']:>4} {off['bs']:>4} {off['tok_per_s']:>10.1f} {on['tok_per_s']:>10.1f} {off['on_over_off']:>6.3f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
