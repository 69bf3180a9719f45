"""--shard-optimizer (ZeRO-1 over each stage's replica group) trains the same model."""

import json

import pytest

from chimera.train.config import TrainConfig
from chimera.train.equivalence import check_virtual

CASES = [("chimera", {}), ("chimera", {"strategy": "doubling"}), ("chimera", {"pipes": 4}),
         ("1f1b", {}), ("chimera-zb", {})]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,options", CASES, ids=[f"{s}-{o}" for s, o in CASES])
@pytest.mark.parametrize("data_parallel", [1, 2])
def test_sharded_optimizer_equals_one_process(schedule, options, data_parallel):
    """Gradients (gathered back from the slices), losses and parameters after 3 AdamW steps
    (clipped) against one process, float64; every replica bit-identical."""
    stages = 4 if options.get("pipes") == 4 or options.get("strategy") else 2
    cfg = TrainConfig(schedule=schedule, stages=stages, data_parallel=data_parallel,
                      micro_batches=2 * stages, micro_batch_size=2, dtype="float64", steps=3,
                      clip=0.5, shard_optimizer=True, **options)
    r = check_virtual(cfg)
    assert r["replicas_identical"] and not r["missing"], r
    assert r["max_grad_rel_err"] < 1e-10 and r["max_loss_rel_err"] < 1e-12, r
    assert r["max_param_rel_err"] < 1e-10, r


def _train(run_cli, tmp_path, name, *args):
    log = tmp_path / f"{name}.jsonl"
    r = run_cli("train", "--steps", "4", "--dtype", "float64", "--no-progress", "--json",
                "--log-json", str(log), *args)
    assert r.returncode == 0, r.stderr
    losses = {json.loads(line)["step"]: json.loads(line)["loss"] for line in log.read_text().splitlines()}
    return json.loads(r.stdout.strip().splitlines()[-1]), losses


@pytest.mark.slow
def test_optimizer_state_halves_and_checkpoints_cross_sharding(tmp_path, run_cli):
    """--json reports optimizer_state_bytes per rank: half with sharding (D=2, W=1); a sharded
    run resumes unsharded and the other way round, on the losses of a straight run."""
    plain, straight = _train(run_cli, tmp_path, "plain")
    sharded, same = _train(run_cli, tmp_path, "sharded", "--shard-optimizer")
    assert same == straight
    for a, b in zip(plain["ranks"], sharded["ranks"]):
        assert b["optimizer_state_bytes"] * 2 == pytest.approx(a["optimizer_state_bytes"], rel=0.01)
    for first, then in (([], ["--shard-optimizer"]), (["--shard-optimizer"], [])):
        ck = str(tmp_path / f"ck{len(first)}")
        _train(run_cli, tmp_path, "first", "--checkpoint-dir", ck, "--steps", "2", *first)
        _, resumed = _train(run_cli, tmp_path, "then", "--checkpoint-dir", ck, "--resume", *then)
        assert {s: resumed[s] for s in (2, 3)} == {s: straight[s] for s in (2, 3)}


def test_parameter_all_gathers_are_prefetched():
    """After the optimizer step the all-gathers are in flight, not waited for: each replica's
    is waited for at its own first forward of the next step, so the gather of a rank's later
    replica overlaps the forwards of its first."""
    from chimera.runtime.virtual import run_virtual
    from chimera.train.loop import Trainer

    cfg = TrainConfig(schedule="chimera", stages=2, micro_batches=4, micro_batch_size=2,
                      dtype="float64", steps=2, shard_optimizer=True)

    def body(rank):
        trainer = Trainer(cfg)
        trainer.step(0)
        in_flight = sorted(trainer.runtime.gathering)
        seen, wait = [], trainer.runtime.executor.before_forward

        def spy(key):
            seen.append((key, sorted(trainer.runtime.gathering)))
            wait(key)

        trainer.runtime.executor.before_forward = spy
        trainer.step(1)
        return sorted(trainer.runtime.modules), in_flight, seen

    for held, in_flight, seen in run_virtual(2, body):
        assert in_flight == held and len(held) == 2  # both replicas' gathers issued, none waited
        first = {}
        for key, pending in seen:
            first.setdefault(key, pending)
        assert len(first) == 2
        (a, at_a), (b, at_b) = sorted(first.items(), key=lambda kv: -len(kv[1]))
        assert at_a == held  # the first forward: both still in flight
        assert at_b == [b]  # the other replica's forward: only its own left, waited for now
        assert all(pending == [] for key, pending in seen[seen.index((b, [b])) + 1:])
