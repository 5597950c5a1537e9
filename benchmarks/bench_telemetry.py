"""Cost of telemetry: a compiled training step with telemetry every N steps against the same step without.

    python benchmarks/bench_telemetry.py --out results/ [--size 1b] [--recipe mxfp8] [--every 100]
    python benchmarks/bench_telemetry.py --dry-run        # the tiny model, eager, on the CPU (tests)

An unsampled step runs the compiled graph, which holds nothing of telemetry (see [Note: telemetry under
torch.compile] in lowprec.telemetry.collect), so it costs what a step without telemetry costs; a sampled
step runs eagerly and computes every operand's figures. Telemetry every N steps therefore costs
``(sampled - plain) / N`` per step on average, printed as a percentage of the plain step.
"""
from __future__ import annotations

import argparse
import statistics

import _common
import _models
import torch
import torch.nn.functional as F

import lowprec
from lowprec import telemetry
from lowprec.train.model import build_model


def make_step(model, compiled: bool, tokens: torch.Tensor, every: int):
    """A step of AdamW under BF16 autocast; ``step(n)`` samples telemetry when ``n`` is due."""
    forward = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), **_models.ADAMW)
    tel = telemetry.Telemetry(every=every)
    x, y = tokens[:, :-1], tokens[:, 1:]  # (B, T) inputs, next tokens as targets

    def step(n: int) -> int:
        opt.zero_grad(set_to_none=True)
        with tel.region(model, n) as sampled, torch.autocast(_common.DEVICE, dtype=torch.bfloat16):
            logits = forward(x)  # (B, T, vocab)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
        opt.step()
        return len(sampled.records) if sampled is not None else 0

    return step


def median_s(step, steps: list[int]) -> tuple[float, int]:
    seconds, records = [], 0
    for n in steps:
        times, records = _common.timed(lambda n=n: step(n), 1, _common.DEVICE)
        seconds += times
    return statistics.median(seconds), records


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1b", choices=list(_models.SIZES))
    ap.add_argument("--recipe", default="mxfp8")
    ap.add_argument("--every", type=int, default=500, help="Telemetry every N steps (the train default).")
    ap.add_argument("--steps", type=int, default=10, help="Timed plain steps, and timed sampled steps.")
    ap.add_argument("--out", default=None, help="Directory for telemetry.json.")
    ap.add_argument("--dry-run", action="store_true", help="The tiny model, eager, 2 steps: checks the script.")
    args = ap.parse_args(argv)
    size = _models.SIZES["tiny" if args.dry_run else args.size]
    compiled = not args.dry_run
    torch.manual_seed(0)
    model = build_model(size.config, seed=0).to(_common.DEVICE)
    conversion = str(lowprec.convert(model, args.recipe))
    tokens = torch.randint(0, size.config.vocab_size, (size.batch, size.seq_len + 1), device=_common.DEVICE)
    step = make_step(model, compiled, tokens, args.every)
    n = 2 if args.dry_run else args.steps
    warm = [1, 2] if args.dry_run else list(range(1, 4))  # unsampled: compile and warm up
    median_s(step, warm)
    median_s(step, [args.every])  # the first sampled step warms the eager path
    plain, _ = median_s(step, [i for i in range(10, 10 + 10 * n) if i % args.every][:n])
    sampled, records = median_s(step, [args.every * (k + 2) for k in range(n)])
    cost = (sampled - plain) / args.every / plain * 100
    result = {"env": _common.environment(), "size": "tiny" if args.dry_run else args.size, "recipe": args.recipe,
              "compiled": compiled, "every": args.every, "plain_step_ms": plain * 1e3,
              "sampled_step_ms": sampled * 1e3, "records_per_sample": records, "cost_pct": cost,
              "conversion": conversion}
    _common.print_table(f"telemetry cost, {result['size']} {args.recipe}", ["plain step (ms)", "sampled step (ms)",
                        "records", f"cost every {args.every} (% of step)"],
                        [[f"{plain * 1e3:.1f}", f"{sampled * 1e3:.1f}", records, f"{cost:.2f}"]])
    if args.out:
        _common.write_json(args.out, "telemetry.json", result)
    return result


if __name__ == "__main__":
    main()
