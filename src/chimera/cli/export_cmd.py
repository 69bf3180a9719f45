"""`chimera export`: a checkpoint (an HF model or a GPT-2 preset) as a save_pretrained folder."""

from __future__ import annotations

import argparse
import sys

from chimera.cli.common import add_checkpoint_input, add_folder_output, check_output


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "export", help="write a checkpoint as a Hugging Face save_pretrained folder",
        description="Write the model of a checkpoint written by `chimera train --checkpoint-dir "
                    "DIR` (--model hf-..., hf:PATH, or a GPT-2 preset, which becomes HF's "
                    "GPT2LMHeadModel) as the folder save_pretrained writes: config.json (the "
                    "run's config and vocabulary, eos/bos token ids), generation_config.json, "
                    "model.safetensors (float32 or float64 as trained; a tied weight once), and "
                    "the tokenizer: the run's tokenizer.json (a byte tokenizer for a run on "
                    "bytes) with tokenizer_config.json and special_tokens_map.json. transformers' "
                    "AutoTokenizer and AutoModelForCausalLM.from_pretrained(OUT) "
                    "(AutoModelForMaskedLM for BERT) load it and give the run's ids and logits. "
                    "Whatever D, W and schedule trained it: checkpoints are keyed by parameter "
                    "name. chimera's BERT presets (bert-*) have no HF twin and are refused.",
        epilog="example: chimera train --model hf-llama-tiny --steps 100 --checkpoint-dir ckpt && "
               "chimera export --checkpoint ckpt --out llama-out")
    add_checkpoint_input(p)
    add_folder_output(p)
    p.add_argument("--merge-lora", action=argparse.BooleanOptionalAction, default=True,
                   help="a run with LoRA adapters (--lora-rank): merge them into their weights "
                        "(W + alpha/r B A; the default), or with --no-merge-lora write the base "
                        "weights alone")
    p.add_argument("--adapter-only", action="store_true",
                   help="write the LoRA adapters alone, as peft does (adapter_config.json, "
                        "adapter_model.safetensors): peft.PeftModel.from_pretrained(base, OUT) "
                        "loads them onto the base model (an export with --no-merge-lora)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from chimera.train.export import export  # start-up time: torch and transformers load when the command runs

    check_output(args.out, "--out", directory=True)
    done = export(args.checkpoint, args.out, args.allow_in_doubt, merge_lora=args.merge_lora,
                  adapter_only=args.adapter_only)
    for note in done.notes:
        print(f"chimera export: {note}", file=sys.stderr)
    print(f"wrote {done.folder}/: {', '.join(done.files)} ({done.model}, step {done.step} of "
          f"{done.checkpoint})")
    return 0
