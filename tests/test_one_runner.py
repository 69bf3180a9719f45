"""One runner (issue 24): ``chimera train`` and the library's ``api.Pipeline`` share one
refusal of a sharded optimizer with weights tied across stages (``chimera.byo``).
"""

import pytest
from torch import nn

from chimera.api import Pipeline
from chimera.byo import refuse_sharded_ties
from chimera.errors import UserError
from chimera.runtime.virtual import run_virtual


def test_one_refusal_of_sharded_ties():
    with pytest.raises(UserError) as expected:
        refuse_sharded_ties(["0.weight"])

    def body(rank):
        emb = nn.Embedding(8, 4)
        head = nn.Linear(4, 8, bias=False)
        head.weight = emb.weight  # tied across the two stages
        with pytest.raises(UserError) as got:
            Pipeline([emb, head], nn.functional.cross_entropy, "1f1b", stages=2,
                     micro_batches=2, shard_optimizer=True)
        return str(got.value)

    assert run_virtual(2, body) == [str(expected.value)] * 2
    refuse_sharded_ties([])  # nothing tied: nothing refused
