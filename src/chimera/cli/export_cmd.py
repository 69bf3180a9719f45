"""`chimera export`: a checkpoint of a Hugging Face model as a save_pretrained folder."""

from __future__ import annotations

import argparse
import sys

from chimera.cli.common import add_checkpoint_input, add_folder_output, check_output


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "export", help="write a checkpoint of a Hugging Face model as a save_pretrained folder",
        description="Write the model of a checkpoint written by `chimera train --model hf-... "
                    "--checkpoint-dir DIR` (or --model hf:PATH) as the folder save_pretrained "
                    "writes: config.json (the run's config and vocabulary) and model.safetensors "
                    "(float32 or float64 as trained; a tied weight once), plus the run's "
                    "tokenizer.json if it recorded one. transformers' "
                    "AutoModelForCausalLM.from_pretrained(OUT) (AutoModelForMaskedLM for BERT) "
                    "loads it and gives the run's logits. Whatever D, W and schedule trained "
                    "it: checkpoints are keyed by parameter name. Checkpoints of chimera's own "
                    "presets (gpt2-*, bert-*) are refused.",
        epilog="example: chimera train --model hf-llama-tiny --steps 100 --checkpoint-dir ckpt && "
               "chimera export --checkpoint ckpt --out llama-out")
    add_checkpoint_input(p)
    add_folder_output(p)
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from chimera.train.export import export  # start-up time: torch and transformers load when the command runs

    check_output(args.out, "--out", directory=True)
    done = export(args.checkpoint, args.out)
    for note in done.notes:
        print(f"chimera export: {note}", file=sys.stderr)
    print(f"wrote {done.folder}/: {', '.join(done.files)} ({done.model}, step {done.step} of "
          f"{done.checkpoint})")
    return 0
