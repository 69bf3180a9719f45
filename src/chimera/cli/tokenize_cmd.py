"""`chimera tokenize`: a BPE tokenizer and token files from local text (no download)."""

from __future__ import annotations

import argparse

from chimera.cli.common import UsageError, add_folder_output, check_output, positive_int


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "tokenize", help="train a BPE tokenizer on local text and write token files for training",
        description="Train a byte-level BPE tokenizer (HF tokenizers) on local text and write "
                    "DIR/tokenizer.json, DIR/train.bin and DIR/val.bin (the last 5% of the ids) "
                    "and DIR/meta.json (dtype, vocabulary). Memory is bounded by a batch of "
                    "text, not by the corpus: the text streams through, the ids stream to disk. Then `chimera train --data DIR` "
                    "trains on them with a model vocabulary of the tokenizer's size; "
                    "`chimera train --data TEXT --tokenizer DIR/tokenizer.json` reads the same ids.")
    p.add_argument("--data", metavar="FILE|DIR", help="text to train the tokenizer on and "
                   "tokenize: a text file or folder, a .jsonl, or a datasets folder's text "
                   "column (default: the Python standard library's source files)")
    p.add_argument("--vocab-size", type=positive_int, metavar="V", help="ids the tokenizer may "
                   "have: <|endoftext|> (id 0, written after every document), 256 bytes and up "
                   "to V - 257 merges (fewer if the text runs out of pairs); required unless "
                   "--tokenizer is given")
    add_folder_output(p)
    p.add_argument("--text-field", metavar="NAME", help="the text of each .jsonl object or "
                   "datasets row (default: text)")
    p.add_argument("--tokenizer", metavar="FILE", help="use this tokenizer.json instead of "
                   "training one (e.g. to tokenize more text with the same ids)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_tokenize)


def cmd_tokenize(args: argparse.Namespace) -> int:
    from chimera.data.bpe import tokenize  # start-up time: tokenizers and numpy load when the command runs
    from chimera.data.formats import META, DataSpec

    if args.vocab_size is None and args.tokenizer is None:
        raise UsageError("--vocab-size is required to train a tokenizer (or give --tokenizer)")
    check_output(args.out, "--out", directory=True)
    spec = DataSpec(args.data, text_field=args.text_field, tokenizer=args.tokenizer)
    meta = tokenize(spec, args.out, args.vocab_size, progress=not args.no_progress)
    made = "used" if args.tokenizer else "trained a BPE tokenizer of"
    print(f"{made} {meta['vocab_size']:,} ids; wrote {args.out}/: tokenizer.json, "
          f"train.bin ({meta['tokens']['train']:,} {meta['dtype']} ids), val.bin "
          f"({meta['tokens']['val']:,}), {META}")
    print(f"train on it: chimera train --data {args.out}")
    return 0
