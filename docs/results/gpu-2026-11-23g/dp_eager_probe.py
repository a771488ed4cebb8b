"""The probe behind d-*.log: one EAGLE3 config with DP attention (--tp 2 --dp 2), CUDA graphs
off, 1 then 48 greedy requests against the target's table; prints RESULT lines or dies.

    python3 dp_eager_probe.py chain-v2|tree-v1 > OUT.log 2>&1     # from the checkout root

It ran on build bc6e8d67. Since 2b11b179 the hook refuses trees with DP attention and no CUDA
graphs (DP_ATTENTION_EAGER_TREE_ERROR), so tree-v1 now stops at that ValueError.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, "tools")
from specpatch.testing import engine as eng  # noqa: E402
from specpatch.testing import synth, synth_eagle3  # noqa: E402

CONFIGS = {"chain-v2": eng.SpecConfig(1, 3, 4), "tree-v1": eng.SpecConfig(4, 3, 8, overlap=False)}
MAX_NEW_TOKENS = 48


def main(label: str) -> None:
    out = Path(os.environ.get("SPECPATCH_MODEL_CACHE", "/tmp/specpatch-models")) / "qwen3-eagle3-aux3-a0.7"
    if not (out / "draft" / synth.META).exists():
        synth_eagle3.make_eagle3_pair(out, "toy", 0.7, device="cuda")
    target, draft = out / "target", out / "draft"
    prompts = eng.random_prompts(48, synth.load_meta(target)["spec"]["vocab"], seed=5)
    expected = synth.table_continuations(target, prompts, MAX_NEW_TOKENS)
    kwargs = eng.engine_kwargs(target, draft, CONFIGS[label], cuda_graph=False, speculative_algorithm="EAGLE3",
                               tp_size=2, dp_size=2, enable_dp_attention=True, enable_dp_lm_head=True)
    with eng.engine(**kwargs) as e:
        print(label, "overlap:", not e.server_args.disable_overlap_schedule, flush=True)
        for n in (1, 48):
            run = eng.generate(e, prompts[:n], MAX_NEW_TOKENS)
            diverged = sum(a != b for a, b in zip(run.output_ids, expected[:n]))
            print(f"RESULT {label} n={n} diverged={diverged} accept={run.accept_length:.3f}", flush=True)


if __name__ == "__main__":  # sglang's schedulers are spawned: they re-import this file
    main(sys.argv[1])
