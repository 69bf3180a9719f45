"""A Hugging Face Llama (RoPE, grouped-query attention) trained as a Chimera pipeline on
padded batches, exported with save_pretrained, reloaded with transformers: same logits.

Run: .venv/bin/python examples/hf_llama.py        (needs the hf extra: pip install -e '.[hf]')
Nothing is downloaded: the model is built from a folder holding only config.json (HF's own
initialization, seeded per layer); a folder written by save_pretrained, with safetensors
weights, loads the same way, each rank reading only the tensors of its stages.
"""

import functools
import os
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import chimera.api as chimera
from chimera import hf

VOCAB, LENGTH = 64, 16


def batch(step: int, rows: int = 16):
    """A toy language (next token = token + 1 mod VOCAB), right-padded rows of random length.
    Labels are the input ids (the loss shifts them), -100 on padding."""
    g = torch.Generator().manual_seed(step)
    ids = (torch.randint(0, VOCAB, (rows, 1), generator=g) + torch.arange(LENGTH)) % VOCAB
    lengths = torch.randint(LENGTH // 2, LENGTH + 1, (rows,), generator=g)
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, -100)


def main(rank: int, world: int, folder: str, out: str) -> None:
    model = hf.load(folder)  # reads the config; layers are built per rank below
    pipe = model.pipeline(schedule="chimera", stages=2, micro_batches=4, micro_batch_size=4)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    for step in range(40):
        opt.zero_grad()
        loss = pipe.step(*batch(step))  # token mean over the labels != -100, as HF's loss
        pipe.clip_grad_norm_(1.0)
        opt.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss:.4f}")
    eval_loss, logits = pipe.eval().eval_step(*batch(1000), return_outputs=True)
    model.save_pretrained(pipe, out)  # every rank calls; rank 0 writes config + safetensors
    if rank == 0:
        torch.save(logits, out + ".logits.pt")
        print(f"eval loss {eval_loss:.4f}; exported to {out}")


def check(out: str) -> None:
    hf_model = LlamaForCausalLM.from_pretrained(out).eval()
    inputs, _ = batch(1000)
    with torch.no_grad():
        logits = hf_model(**inputs).logits
    diff = float((logits - torch.load(out + ".logits.pt")).abs().max())
    assert diff < 1e-5, diff
    print(f"transformers reloads the export: its logits match the pipeline's (max diff {diff:.1e})")


if __name__ == "__main__":
    folder = tempfile.mkdtemp()
    LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH,
                bos_token_id=0, eos_token_id=0).save_pretrained(folder)
    out = os.path.join(folder, "trained")
    chimera.spawn(functools.partial(main, folder=folder, out=out), world=2)
    check(out)
