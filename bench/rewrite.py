"""Rewriter generation speed: the local backend against plain transformers `generate`, as a ratio.

Both decode greedily with the KV cache on the same text encoder (the tiny checkpoint's Qwen3-VL,
random weights) from the same prompt; ours goes through the stage door, our stopping criterion
(cancel check, progress, JSON scanner) and the device-following head. EOS is suppressed on both
sides (`min_new_tokens`), so every run writes exactly `--tokens` tokens. Runs alternate, and the
median of `--repeats` is reported. Offload modes other than `none` are listed for the door's cost.

    python bench/rewrite.py                 # 128 tokens, 5 repeats, modes none,model
    python bench/rewrite.py --quick         # 16 tokens, 1 repeat (smoke test)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import environment, fmt, print_machine, table, write_json  # noqa: E402


def _plain_generate(encoder, processor, text: str, tokens: int) -> int:
    inputs = processor(text=[text], return_tensors="pt")
    with torch.no_grad():
        out = encoder.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                               use_cache=True, temperature=None, top_p=None, top_k=None)
    return int(out.shape[-1] - inputs["input_ids"].shape[-1])


def main(argv: list[str] | None = None) -> int:
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.placement.door import configure_offload
    from lingbot_core.rewrite import generate_text
    from lingbot_core.rewrite.local_backend import chat_text
    from lingbot_core.tiny import ensure_tiny_checkpoint

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--modes", default="none,model")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats = 16, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    print_machine()
    base = PipelineHandle.open(ensure_tiny_checkpoint("dense"), device="cpu")
    system, user = "You write captions.", "Request: a red paper boat on a canal at dawn"
    text = chat_text(system, user, False)

    # ours suppresses EOS the same way (min_new_tokens), passed through a wrapper around generate
    original_generate = type(base.component("text_encoder")).generate

    def forced(self, *a, **kw):
        kw["min_new_tokens"] = kw["max_new_tokens"]
        return original_generate(self, *a, **kw)

    rows, figures = [], {}
    for mode in args.modes.split(","):
        handle = configure_offload(base, mode, **({"use_stream": False} if mode == "group" else {}))
        ours_t, plain_t = [], []
        generate_text(handle, system, user, max_new_tokens=4)  # warm-up
        for _ in range(args.repeats):
            type(base.component("text_encoder")).generate = forced
            try:
                start = time.perf_counter()
                made = generate_text(handle, system, user, max_new_tokens=args.tokens)
                ours_t.append(made.tokens / (time.perf_counter() - start))
            finally:
                type(base.component("text_encoder")).generate = original_generate
            if mode == "none":
                encoder, processor = base.component("text_encoder"), base.component("processor")
                start = time.perf_counter()
                count = _plain_generate(encoder, processor, text, args.tokens)
                plain_t.append(count / (time.perf_counter() - start))
        ours = statistics.median(ours_t)
        plain = statistics.median(plain_t) if plain_t else None
        figures[mode] = {"ours_tokens_per_s": ours, "plain_generate_tokens_per_s": plain,
                         "ratio": ours / plain if plain else None}
        rows.append([mode, fmt(ours), fmt(plain) if plain else "-", fmt(ours / plain) if plain else "-"])
    print(f"rewriter generation, tiny Qwen3-VL, {args.tokens} tokens, median of {args.repeats}")
    print(table(["mode", "ours tok/s", "generate tok/s", "ours / generate"], rows))
    write_json(args.json, {"tokens": args.tokens, "repeats": args.repeats, "figures": figures,
                           "environment": environment()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
