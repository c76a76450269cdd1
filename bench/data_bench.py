"""Token store benchmark: build a store from a synthetic JSONL chat file, open it, read batches.

    python bench/data_bench.py --conversations 800000 --seq-len 1024     # the issue's scale
    python bench/data_bench.py --conversations 2000 --seq-len 128        # a quick check

The data: user turns of 8-64 words and assistant turns whose lengths are lognormal (median a
quarter of seq_len, sigma 1, capped at 2 x seq_len so some conversations are cut), words drawn
from the embedded tokenizer's vocabulary (one word is one token). The path measured is the real
one: `iter_conversations` streams the JSONL, the embedded tokenizer and ChatFormat tokenize it,
`open_or_build` writes the store (no regeneration: that is the target's work, measured apart).

Each phase runs in a fresh process, so its peak RSS is its own:
  build   stream the file into a new store (first start of a run)
  open    open the existing store (checksum check), pack the rows, read 50 batches (later starts)
It prints the seconds and the peak RSS (ru_maxrss) of each, and the store's size on disk.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_jsonl(path: Path, conversations: int, seq_len: int, words: list[str], seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocabulary = np.array(words)
    answers = np.minimum(rng.lognormal(np.log(seq_len / 4), 1.0, conversations), 2 * seq_len).astype(int)
    prompts = rng.integers(8, 65, conversations)
    with path.open("w") as handle:
        for prompt, answer in zip(prompts, answers, strict=True):
            picked = vocabulary[rng.integers(0, len(vocabulary), prompt + max(answer, 1))]
            record = {
                "messages": [
                    {"role": "user", "content": " ".join(picked[:prompt])},
                    {"role": "assistant", "content": " ".join(picked[prompt:])},
                ]
            }
            handle.write(json.dumps(record) + "\n")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def phase(args) -> dict:
    """One phase in this process (build or open); returns its figures."""
    from trainer.data.chat import ChatFormat, iter_conversations, tokenize_stream
    from trainer.data.embedded import ensure_embedded
    from trainer.data.rows import Loader, build_train_set
    from trainer.data.store import open_or_build
    from trainer.model.target import load_tokenizer

    target_path, _ = ensure_embedded(args.cache)
    chat = ChatFormat(load_tokenizer(target_path))

    source_s = [0.0]  # time spent reading and tokenizing the JSONL (the rest of a build is the store's)

    def examples():
        """The product's path: the file streamed and tokenized a chunk of conversations at a time
        (chat.tokenize_stream), the time spent there counted apart from the store's own."""
        conversations = (messages for _, messages in iter_conversations(args.data))
        stream = tokenize_stream(conversations, chat)
        while True:
            began = time.monotonic()
            example = next(stream, None)
            source_s[0] += time.monotonic() - began
            if example is None:
                return
            yield example

    started = time.monotonic()
    store = open_or_build(Path(args.store), f"data-bench|{args.data}", chat, examples, log=lambda _: None)
    opened = time.monotonic() - started
    row = {"phase": args.phase, "store_s": opened, "conversations": store.conversations}
    if args.phase == "build":
        row["read_and_tokenize_s"] = source_s[0]
    if args.phase == "open":
        started = time.monotonic()
        train_set = build_train_set(store, args.seq_len, 0, packing=True, seed=0)
        loader = Loader(train_set, batch_size=8, seed=0)
        row["pack_s"] = time.monotonic() - started
        started = time.monotonic()
        for _ in range(50):
            loader.next_batch()
        row["batch_ms"] = (time.monotonic() - started) / 50 * 1000
        row["rows"] = train_set.rows
        row["real_token_share"] = train_set.real_token_share()
        row["padded_real_token_share"] = build_train_set(store, args.seq_len, 0, False, 0).real_token_share()
        row["cut"] = train_set.cut
    row["peak_rss_mb"] = peak_rss_mb()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=800_000)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--dir", default="/tmp/dflash-data-bench", help="data file, store and cache go here")
    parser.add_argument("--phase", default="", help=argparse.SUPPRESS)  # a child process's phase
    parser.add_argument("--data", default="", help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    parser.add_argument("--cache", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(args)))
        return 0

    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    cache, store = work / "cache", work / f"store-{args.conversations}-{args.seq_len}"
    data = work / f"chat-{args.conversations}-{args.seq_len}.jsonl"
    if not data.exists():
        from trainer.data.embedded import SPECIAL_TOKENS, _vocabulary, ensure_embedded

        ensure_embedded(cache)
        words = [
            w for w in _vocabulary() if w not in SPECIAL_TOKENS and w not in ("user", "assistant", "system")
        ]
        started = time.monotonic()
        partial = data.with_suffix(".partial")
        write_jsonl(partial, args.conversations, args.seq_len, words, seed=0)
        partial.rename(data)
        print(f"wrote {data} ({data.stat().st_size / 1e9:.2f} GB) in {time.monotonic() - started:.0f}s")
    if store.exists():
        import shutil

        shutil.rmtree(store)  # the build is what is measured
    rows = []
    for name in ("build", "open"):
        command = [sys.executable, __file__, "--phase", name, "--data", str(data), "--store", str(store)]
        command += ["--cache", str(cache), "--seq-len", str(args.seq_len)]
        started = time.monotonic()
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            print(result.stderr, file=sys.stderr)
            return 1
        row = json.loads(result.stdout.splitlines()[-1])
        row["process_s"] = time.monotonic() - started
        rows.append(row)
        print(json.dumps(row))
    size = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    build, opened = rows
    print(
        f"{args.conversations} conversations, seq_len {args.seq_len}: build {build['store_s']:.1f}s "
        f"({build['read_and_tokenize_s']:.1f}s of it reading and tokenizing the JSONL; peak RSS "
        f"{build['peak_rss_mb']:.0f} MB); later start: open {opened['store_s']:.1f}s + pack "
        f"{opened['pack_s']:.1f}s (peak RSS {opened['peak_rss_mb']:.0f} MB); a batch of 8 rows "
        f"{opened['batch_ms']:.1f} ms; {opened['rows']} packed rows, real tokens "
        f"{opened['real_token_share']:.0%} packed vs {opened['padded_real_token_share']:.0%} padded; "
        f"{opened['cut']} cut; store "
        f"{size / 1e9:.2f} GB on disk"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
