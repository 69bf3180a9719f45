"""Documents packed into one sequence and kept apart (chimera.models.packing): chimera's GPT-2
run on a packed row with ``segments`` gives each document the logits it has alone (float64)."""

import torch

from chimera.models import build_layers, get_config
from chimera.models.packing import document_mask, document_positions, document_segments

EOS = 0


def _run(layers, ids, segments=None):
    x = layers[0](ids, segments)
    for block in layers[1:-1]:
        x = block(x, segments)
    return layers[-1](x)                                            # (B, T, V)


def test_segments_positions_and_mask():
    ids = torch.tensor([[5, 6, EOS, 7, EOS, 8, 9]])
    seg = document_segments(ids, EOS)
    assert seg.tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    assert document_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    mask = document_mask(seg)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False]
    assert mask[1].tolist() == [True, True, False, False, False, False, False]


def test_a_packed_row_equals_its_documents_run_one_by_one():
    cfg = get_config("gpt2-tiny", vocab_size=50, seq_len=16)
    torch.manual_seed(0)
    layers = [layer.double().eval() for layer in build_layers(cfg, 0, range(cfg.n_layers_total))]
    gen = torch.Generator().manual_seed(1)
    docs = [torch.cat([torch.randint(1, 50, (n,), generator=gen), torch.tensor([EOS])])
            for n in (4, 6, 1)]
    tail = torch.randint(1, 50, (2,), generator=gen)                 # a document cut by the window
    packed = torch.cat([*docs, tail])[None]                          # (1, 16)
    with torch.no_grad():
        together = _run(layers, packed, document_segments(packed, EOS))[0]
        unmasked = _run(layers, packed)[0]
        start = 0
        for doc in [*docs, tail]:
            alone = _run(layers, doc[None])[0]
            torch.testing.assert_close(together[start:start + len(doc)], alone, rtol=0, atol=1e-12)
            start += len(doc)
    assert not torch.allclose(together[4:], unmasked[4:])            # it is the mask that does it
