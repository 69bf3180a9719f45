"""`chimera generate`: continue a prompt with a model trained by `chimera train`."""

from __future__ import annotations

import argparse
import json
import sys

import time

from chimera.cli.common import UsageError, add_checkpoint_input, nonneg_float, positive_int
from chimera.errors import UserError

MAX_NEW_TOKENS = 100_000  # chimera.train.generate.MAX_NEW_TOKENS (that module imports torch)


def new_tokens(text: str) -> int:
    n = positive_int(text)
    if n > MAX_NEW_TOKENS:
        raise argparse.ArgumentTypeError(f"at most {MAX_NEW_TOKENS:,} tokens a run, got {n:,}")
    return n


def probability(text: str) -> float:
    try:
        p = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < p <= 1:  # nan fails too
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1: no cut), got {text}")
    return p


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "generate", help="sample text from a trained checkpoint (GPT-2 presets, HF GPT-2 and Llama)",
        description="Continue a prompt with the model of a checkpoint written by `chimera train "
                    "--checkpoint-dir DIR`, in this one process, whatever D, W and schedule trained "
                    "it (checkpoints are keyed by parameter name), with the layers the run trained (chimera's "
                    "GPT-2, or a Hugging Face GPT-2 / Llama rebuilt from the config the run "
                    "recorded), with a key/value cache: each new token is one forward of one "
                    "position per layer. Several --prompt run as one batch. Tokens are UTF-8 bytes unless "
                    "the run recorded a tokenizer (or --tokenizer names one). A prompt longer "
                    "than the model's context keeps its last tokens (the command says so). BERT "
                    "checkpoints (chimera's or HF's) are refused: a masked LM does not continue text left to right. "
                    "Prints the prompt followed by the continuation.",
        epilog="example: chimera train --steps 200 --checkpoint-dir ckpt && "
               "chimera generate --checkpoint ckpt --prompt 'def main(' --temperature 0")
    add_checkpoint_input(p)
    p.add_argument("--prompt", required=True, action="append", metavar="TEXT",
                   help="the text to continue (UTF-8); repeat for a batch of prompts, run together")
    p.add_argument("--max-new-tokens", type=new_tokens, default=200, metavar="N",
                   help=f"tokens to add to each prompt, 1 to {MAX_NEW_TOKENS:,} (bytes with byte "
                        "tokens; default: 200)")
    p.add_argument("--temperature", type=nonneg_float, default=0.8, metavar="T",
                   help="divide the logits by T before sampling; 0 = greedy, always the most "
                        "likely token (default: 0.8)")
    p.add_argument("--top-k", type=positive_int, metavar="K",
                   help="sample among the K most likely tokens only (default: all)")
    p.add_argument("--top-p", type=probability, metavar="P",
                   help="sample among the most likely tokens whose probabilities add up to P, "
                        "0 < P <= 1 (nucleus sampling; default: 1, all)")
    p.add_argument("--stop-token", metavar="TEXT",
                   help="a prompt's continuation ends when it draws this token (its text, one "
                        "token, e.g. $'\\n'; not printed); default: the tokenizer's end-of-text "
                        "token (<|endoftext|>, </s>), none for bytes")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sampler: the same seed gives the same text (default: 0)")
    p.add_argument("--tokenizer", metavar="FILE", help="a tokenizers file (tokenizer.json) to "
                   "use instead of the one the run recorded, or of bytes")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch threads (default: 1; a small model decodes fastest on one)")
    p.add_argument("--json", action="store_true", help="print one JSON object a prompt: text, "
                   "completion, token ids, checkpoint, step, stopped, start-up and decode seconds")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    for prompt in args.prompt:  # argv's undecodable bytes arrive as lone surrogates
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UsageError(f"--prompt is not valid UTF-8 (an undecodable byte at character "
                             f"{exc.start}): give UTF-8 text") from None
    # torch: imported when the command runs, so that every other command starts without it
    import torch

    from chimera.train.generate import Settings, generate_batch

    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda: no GPU is visible to this torch; use --device cpu")
    settings = Settings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    imported = time.perf_counter()
    outs = generate_batch(args.checkpoint, args.prompt, settings, args.device, args.tokenizer,
                          args.stop_token, args.allow_in_doubt)
    for note in dict.fromkeys(n for out in outs for n in out.notes):
        print(f"chimera generate: {note}", file=sys.stderr)
    for out in outs:
        if args.json:
            print(json.dumps({"text": out.text, "completion": out.completion,
                              "prompt_ids": out.prompt_ids, "new_ids": out.new_ids,
                              "cropped": out.cropped, "checkpoint": out.checkpoint, "step": out.step,
                              "tokens": out.codec, "stopped": out.stopped,
                              "startup_s": round(imported - start + out.timing["load_s"], 4),
                              "decode_s": round(out.timing["decode_s"], 4)}))
        else:
            print(out.text)
    sys.stdout.flush()  # the text first, then the timing line after it
    _report_time(outs, imported - start)
    return 0


def _report_time(outs, torch_s: float) -> None:
    timing = outs[0].timing
    made = sum(len(o.new_ids) for o in outs)
    print(f"chimera generate: start-up {torch_s + timing['load_s']:.2f} s (torch {torch_s:.2f} s, "
          f"checkpoint and model {timing['load_s']:.2f} s); {made} tokens in "
          f"{timing['decode_s']:.2f} s", file=sys.stderr)
