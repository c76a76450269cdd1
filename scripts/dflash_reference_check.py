"""An exported drafter checked by the reference DFlash code (the `dflash` package, importable):
loaded with no missing or unexpected weights, then greedy speculative decoding on a few prompts
must give the target's own greedy answer token for token; prints its mean acceptance length.

    python scripts/dflash_reference_check.py EXPORT_DIR TARGET_DIR CHAT_JSONL [--prompts 4]
        [--max-new-tokens 64] [--device cuda] [--dtype float32]

The prompts are the first user turns of the data file's last conversations (the run's held-out
ones). Exits 1 on any difference, 0 otherwise. Float32 by default: speculative decoding verifies a
block of tokens in one forward where greedy decoding takes them one at a time, and in bfloat16 those
two sums round differently; a target with random weights has near-equal top logits, so the rounding
flips its argmax within a few tokens (8B shape, one H200: 0/4 prompts equal in bfloat16, 4/4 in
float32). --dtype bfloat16 checks the precision a deployment decodes in, which means something with
trained weights only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def held_out_prompts(chat_file: Path, tokenizer, count: int) -> list[list[int]]:
    """The last `count` conversations up to their first assistant turn, as the trainer takes them."""
    from trainer.data.chat import ChatFormat, prompt_ids, tokenize

    chat = ChatFormat(tokenizer)
    conversations = [json.loads(line)["messages"] for line in chat_file.read_text().splitlines()[-count:]]
    examples = tokenize(conversations, chat)
    firsts = [next(i for i, (role, _) in enumerate(e.turns) if role == "assistant") for e in examples]
    return [prompt_ids(e, chat, turn) for e, turn in zip(examples, firsts, strict=True)]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("export_dir")
    parser.add_argument("target_dir")
    parser.add_argument("chat_file")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()

    import dflash.model as reference

    if not args.device.startswith("cuda"):
        # The reference times its stats with torch.cuda.synchronize; on a CPU (a rehearsal) a plain
        # clock does, and the answers are the same.
        reference._cuda_time = time.perf_counter
    from trainer.model.target import load_target, load_tokenizer

    started = time.monotonic()
    drafter, info = reference.DFlashDraftModel.from_pretrained(args.export_dir, output_loading_info=True)
    problems = {key: info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys") if info[key]}
    if problems:
        print(f"FAIL: the export does not load cleanly: {problems}")
        return 1
    drafter = drafter.to(args.device, getattr(torch, args.dtype)).eval()
    target = load_target(args.target_dir, args.device, args.dtype)
    tokenizer = load_tokenizer(args.target_dir)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    print(f"loaded the export ({sum(p.numel() for p in drafter.parameters()) / 1e9:.2f} B parameters) "
          f"and the target in {time.monotonic() - started:.1f} s")  # fmt: skip
    accepted, differences = [], 0
    for number, prompt in enumerate(held_out_prompts(Path(args.chat_file), tokenizer, args.prompts)):
        ids = torch.tensor([prompt], device=args.device)
        with torch.no_grad():
            result = reference.dflash_generate(
                drafter, target, ids, args.max_new_tokens, [end_id], temperature=0.0, return_stats=True
            )
            greedy = target.generate(
                ids,
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                eos_token_id=end_id,
                pad_token_id=end_id,
            )
        same = result.output_ids[0].tolist() == greedy[0].tolist()
        differences += not same
        accepted += result.acceptance_lengths
        mean = sum(result.acceptance_lengths) / len(result.acceptance_lengths)
        print(f"prompt {number}: {len(prompt)} tokens, {'lossless' if same else 'DIFFERS from greedy'}, "
              f"mean acceptance length {mean:.2f}")  # fmt: skip
    tau = sum(accepted) / max(len(accepted), 1)
    print(f"reference dflash: {args.prompts - differences}/{args.prompts} prompts lossless, "
          f"acceptance length {tau:.3f}")  # fmt: skip
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
