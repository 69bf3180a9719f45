"""`chimera profile`: per-layer costs of a model and this machine's links, as a profile JSON."""

from __future__ import annotations

import argparse
import json
import os

from chimera.cli.common import check_output, positive_int


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "profile", help="measure per-layer F/B/I/W times, bytes and p2p/allreduce links here",
        description="Measure a model's per-layer forward, backward and split-backward (I, W) "
                    "times, the bytes each layer keeps for backward and sends on, and the "
                    "alpha-beta cost of p2p and allreduce between two gloo processes on this "
                    "machine; write them as a chimera.profile/1 JSON that `chimera simulate "
                    "--profile` and `chimera plan --profile` read.")
    p.add_argument("--model", default="gpt2-bench", help="model preset (default: gpt2-bench)")
    p.add_argument("--micro-batch-size", "-B", type=positive_int, default=2,
                   help="sequences per micro-batch to measure at (default: 2)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (default: 1)")
    p.add_argument("--repeat", type=positive_int, default=5, help="repeats per measurement (median)")
    p.add_argument("--out", metavar="FILE", help="where to write the profile "
                   "(default: out/profile-MODEL-B<size>.json)")
    p.add_argument("--json", action="store_true", help="also print the profile as one JSON object")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    # torch: imported when the command runs, so that every other command starts without it
    from chimera.bench.profiler import build_profile
    from chimera.models import get_config

    get_config(args.model)  # unknown model: one line, exit 2
    out = args.out or os.path.join("out", f"profile-{args.model}-B{args.micro_batch_size}.json")
    check_output(out, "--out")  # before minutes of measuring
    data = build_profile(args.model, args.micro_batch_size, args.threads, args.repeat)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(data, f, indent=1)
    if args.json:
        print(json.dumps(data))
        return 0
    print(f"{args.model}, micro-batch {args.micro_batch_size}, {args.threads} thread(s): "
          f"median of {args.repeat}")
    print(f"{'layer':<10} {'F ms':>7} {'B ms':>7} {'I ms':>7} {'W ms':>7} {'act MB':>7} {'out MB':>7} {'param MB':>8}")
    for x in data["layers"]:
        print(f"{x['name']:<10} {x['forward_s'] * 1e3:>7.2f} {x['backward_s'] * 1e3:>7.2f} "
              f"{x['input_backward_s'] * 1e3:>7.2f} {x['weight_backward_s'] * 1e3:>7.2f} "
              f"{x['activation_bytes'] / 2**20:>7.2f} {x['output_bytes'] / 2**20:>7.2f} "
              f"{x['param_bytes'] / 2**20:>8.2f}")
    for key in ("p2p", "allreduce"):
        link = data[key]
        print(f"{key}: alpha {link['alpha_s'] * 1e6:.1f} us, beta {link['beta_bytes_per_s'] / 1e9:.2f} GB/s"
              + (" (per ring step)" if key == "allreduce" else ""))
    print(f"wrote {out}")
    return 0
