"""`chimera generate`: continue a prompt with a model trained by `chimera train`."""

from __future__ import annotations

import argparse
import json
import sys

from chimera.cli.common import add_checkpoint_input, nonneg_float, positive_int
from chimera.errors import UserError


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "generate", help="sample text from a trained checkpoint (GPT-2 presets, HF GPT-2 and Llama)",
        description="Continue a prompt with the model of a checkpoint written by `chimera train "
                    "--checkpoint-dir DIR`, in this one process, whatever D, W and schedule trained "
                    "it (checkpoints are keyed by parameter name), with the layers the run trained (chimera's "
                    "GPT-2, or a Hugging Face GPT-2 / Llama rebuilt from the config the run "
                    "recorded). Tokens are UTF-8 bytes unless "
                    "the run recorded a tokenizer (or --tokenizer names one). A prompt longer "
                    "than the model's context keeps its last tokens (the command says so). BERT "
                    "checkpoints (chimera's or HF's) are refused: a masked LM does not continue text left to right. "
                    "Prints the prompt followed by the continuation.",
        epilog="example: chimera train --steps 200 --checkpoint-dir ckpt && "
               "chimera generate --checkpoint ckpt --prompt 'def main(' --temperature 0")
    add_checkpoint_input(p)
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    p.add_argument("--max-new-tokens", type=positive_int, default=200, metavar="N",
                   help="tokens to add (bytes with byte tokens; default: 200)")
    p.add_argument("--temperature", type=nonneg_float, default=0.8, metavar="T",
                   help="divide the logits by T before sampling; 0 = greedy, always the most "
                        "likely token (default: 0.8)")
    p.add_argument("--top-k", type=positive_int, metavar="K",
                   help="sample among the K most likely tokens only (default: all)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sampler: the same seed gives the same text (default: 0)")
    p.add_argument("--tokenizer", metavar="FILE", help="a tokenizers file (tokenizer.json) to "
                   "use instead of the one the run recorded, or of bytes")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch threads (default: 1; a small model decodes fastest on one)")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, completion, "
                   "token ids, checkpoint, step")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    # torch: imported when the command runs, so that every other command starts without it
    import torch

    from chimera.train.generate import generate

    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda: no GPU is visible to this torch; use --device cpu")
    out = generate(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature,
                   args.top_k, args.seed, args.device, args.tokenizer)
    for note in out.notes:
        print(f"chimera generate: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps({"text": out.text, "completion": out.completion,
                          "prompt_ids": out.prompt_ids, "new_ids": out.new_ids,
                          "cropped": out.cropped, "checkpoint": out.checkpoint, "step": out.step,
                          "tokens": out.codec}))
    else:
        print(out.text)
    return 0
