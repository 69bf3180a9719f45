"""`chimera judge`: give a checkpoint its run never judged a verdict (healthy or in doubt)."""

from __future__ import annotations

import argparse

from chimera.cli.common import add_checkpoint_input, positive_int
from chimera.errors import UserError


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "judge", help="judge a checkpoint its run never judged (healthy or in doubt)",
        description="A run judges each checkpoint by the loss of its weights on the next "
                    "mini-batch; a run killed right after publishing one leaves it not judged, "
                    "and `chimera generate` and `chimera export` refuse it. This runs that "
                    "judgement: the run's config (config.toml) as one process, the checkpoint "
                    "loaded, one forward-only pass over the mini-batch after it, the run's rule "
                    "(a NaN or infinite loss, or a spike above --spike-factor times the median "
                    "of the recorded healthy losses, is in doubt), and records the verdict in its "
                    "meta.json, as the run would have. Given a run's --checkpoint-dir, judges "
                    "every checkpoint in it not judged yet; given a step-<n> folder, judges it "
                    "(again). Exit code 0: healthy; 1: some checkpoint is in doubt.",
        epilog="example: chimera judge --checkpoint ckpt && chimera export --checkpoint ckpt "
               "--out model")
    add_checkpoint_input(p, served=False)
    p.add_argument("--data", metavar="PATH",
                   help="the run's data, where it is now (default: the path its config records)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (default: 1)")
    p.set_defaults(func=cmd_judge)


def cmd_judge(args: argparse.Namespace) -> int:
    import torch  # start-up time: torch loads when the command runs

    from chimera.train.judge import judge

    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no GPU is visible to this torch; use --device cpu")
    verdicts = judge(args.checkpoint, args.data, args.device)
    if not verdicts:
        print(f"{args.checkpoint}: every checkpoint has its verdict already (nothing to judge)")
    for v in verdicts:
        median = "" if v.reference is None else f"; recorded healthy median {v.reference:.4g}"
        verdict = "healthy" if v.why is None else f"in doubt: {v.why}"
        print(f"{v.path}: {verdict} (loss {v.loss:.4g} on mini-batch {v.step}{median})")
    return 1 if any(v.why is not None for v in verdicts) else 0
