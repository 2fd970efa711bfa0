"""Two checkouts side by side, runs alternated: what a change costs or saves,
below the noise that separates two passes of ``make bench``.

Run with ``make bench-pair BASE=<another checkout>`` (for example after
``git worktree add ../base main``), or ``python -m bench.bench_pair BASE``.

Each side is a process of its own, with its checkout first on ``PYTHONPATH``
(every component's source root, so its code shadows the editable install)
and as its working directory. It starts that checkout's stack as
``bench.bench_turn`` deploys it (``dagnats dev --no-demo`` with nats-server
at ``sync_interval: always``, a worker process) and waits for orders on its
standard input. Both stacks are up at once; the driver has them run the same
unit of work in turn, this checkout first in every other pair, so that both
see the machine alike:

- ``seq``: one run of ``BENCH_K`` iterations, ms per journaled step;
- ``thr``: a round of ``BENCH_C`` runs at once, steps/s, with the CPU each
  process of the side spent (ms per step);
- ``start``: a K=1 run, from its start to its result seen by the client, ms.

It reports each side's median, and the median of the ratio of each pair
(this checkout over BASE) with how often this checkout did better. The
base checkout needs the turn bench (ADR 30 on): ``bench.bench_turn``, or
``tests.bench_turn`` in a checkout from before the benchmarks left ``tests/``
(``turn_module`` looks). Knobs:
``BENCH_PAIRS_SEQ`` (40), ``BENCH_PAIRS_THR`` (8), ``BENCH_PAIRS_START``
(100), ``BENCH_K`` and ``BENCH_C``; a count of 0 leaves that measure out.
Nothing asserts on time.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent.parent
MEASURES = ("seq", "thr", "start")


def source_roots(tree: Path) -> list[Path]:
    """The source roots of the checkout ``tree``, one per component (ADR 1)."""
    roots = [tree / "core", tree / "cli", tree / "sdk"]
    roots += sorted(p for p in (tree / "services").iterdir() if (p / "dagnats").is_dir())
    return [root for root in roots if (root / "dagnats").is_dir()]


# Where a checkout keeps the turn bench: ``bench/`` now, ``tests/`` before.
TURN_MODULES = ("bench.bench_turn", "tests.bench_turn")


def turn_module(tree: Path) -> str | None:
    """The module of checkout ``tree`` that deploys the turn bench's stack,
    found by its file; None when the checkout has none."""
    for module in TURN_MODULES:
        if (tree / (module.replace(".", "/") + ".py")).is_file():
            return module
    return None


def counts(env: Mapping[str, str]) -> dict[str, int]:
    """Pairs per measure, from ``BENCH_PAIRS_*``; a bad one stops with its name."""
    from bench.bench_turn import knob

    defaults = {"seq": 40, "thr": 8, "start": 100}
    return {m: knob(env, f"BENCH_PAIRS_{m.upper()}", n, 0) for m, n in defaults.items()}


@dataclass(frozen=True, slots=True)
class Paired:
    """One measure over all pairs: each side's median and the pairs' ratio."""

    measure: str
    base: float
    this: float
    ratio: float  # median of this / base over the pairs
    better: int  # pairs in which this checkout did better
    pairs: int


def paired(measure: str, base: Sequence[float], this: Sequence[float], *, lower: bool) -> Paired:
    """Summarize the pairs of ``measure`` (``lower``: less is better)."""
    # A pair in which the base measured nothing (a process idle for the
    # whole round) has no ratio; the medians still show it.
    ratios = [t / b for b, t in zip(base, this, strict=True) if b] or [float("nan")]
    better = sum(1 for b, t in zip(base, this, strict=True) if (t < b if lower else t > b))
    return Paired(
        measure,
        statistics.median(base),
        statistics.median(this),
        statistics.median(ratios),
        better,
        len(ratios),
    )


def table(rows: Sequence[Paired], base: str, this: str) -> str:
    """The rows, aligned, under the two checkouts' names."""
    width = max([len("measure"), *(len(r.measure) for r in rows)])
    lines = [
        f"base: {base}",
        f"this: {this}",
        f"{'measure':{width}} {'base':>9} {'this':>9} {'this/base':>10}  this better in",
    ]
    for r in rows:
        lines.append(
            f"{r.measure:{width}} {r.base:9.3f} {r.this:9.3f} {r.ratio:9.3f}x  "
            f"{r.better}/{r.pairs} pairs"
        )
    return "\n".join(lines)


# ---- a side --------------------------------------------------------------------------------


async def side(root: Path) -> None:
    """Serve orders on stdin with the stack of checkout ``root``: one JSON
    line of results per order line, until an empty line."""
    import asyncio
    import importlib
    import tempfile

    sys.path.insert(0, str(root))
    from dagnats.sdk import Client
    from tests.stack import loop_workflow

    module = turn_module(root)
    if module is None:
        raise SystemExit(f"{root} has no turn bench")
    bt = importlib.import_module(module)
    task = bt.TASK
    p = bt.Params.from_env(os.environ)
    stack = bt.start_stack(Path(tempfile.mkdtemp(prefix="bench-pair-")), p)
    try:
        async with Client(stack.engine) as client:
            await client.register_workflow(loop_workflow(task, task, max_iterations=10_000))

            async def run(k: int) -> None:
                await client.run(task, {"k": k}, timeout=120 + k)

            await asyncio.gather(*(run(p.k) for _ in range(p.c)))  # warm
            print("ready", flush=True)
            loop = asyncio.get_running_loop()
            while order := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
                began, cpu = time.perf_counter(), stack.cpu()
                if order == "seq":
                    await run(p.k)
                elif order == "thr":
                    await asyncio.gather(*(run(p.k) for _ in range(p.c)))
                else:
                    await run(1)
                wall, spent = time.perf_counter() - began, stack.cpu()
                steps = {"seq": p.k, "thr": p.k * p.c, "start": 1}[order] * 2
                print(
                    json.dumps(
                        {
                            "wall": wall,
                            "steps": steps,
                            "cpu": {k: (spent[k] - cpu[k]) * 1000 / steps for k in cpu},
                        }
                    ),
                    flush=True,
                )
    finally:
        bt.stop_stack(stack)


# ---- the driver ----------------------------------------------------------------------------


class Side:
    def __init__(self, tree: Path) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(r) for r in source_roots(tree)] + [env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
        self.tree = tree
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "side", str(tree)],
            cwd=tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self._line() != "ready":
            raise SystemExit(f"the stack of {tree} did not start")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def order(self, measure: str) -> dict[str, Any]:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(measure + "\n")
        stdin.flush()
        line = self._line()
        if not line:
            raise SystemExit(f"the side of {self.tree} stopped")
        result: dict[str, Any] = json.loads(line)
        return result

    def stop(self) -> None:
        """Have the side stop its stack and exit (killed after a minute)."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write("\n")
                self.proc.stdin.flush()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def summarize(measure: str, base: list[dict[str, Any]], this: list[dict[str, Any]]) -> list[Paired]:
    if measure == "seq":
        ms = [[1000 * r["wall"] / r["steps"] for r in side] for side in (base, this)]
        return [paired("seq: ms per journaled step", *ms, lower=True)]
    if measure == "start":
        ms = [[1000 * r["wall"] for r in side] for side in (base, this)]
        return [paired("start: K=1 run to result seen, ms", *ms, lower=True)]
    rates = [[r["steps"] / r["wall"] for r in side] for side in (base, this)]
    rows = [paired("thr: journaled steps/s", *rates, lower=False)]
    for name in base[0]["cpu"]:
        cpu = [[r["cpu"][name] for r in side] for side in (base, this)]
        rows.append(paired(f"thr: CPU ms per step, {name}", *cpu, lower=True))
    total = [[sum(r["cpu"].values()) for r in side] for side in (base, this)]
    rows.append(paired("thr: CPU ms per step, all", *total, lower=True))
    return rows


def main(argv: Sequence[str]) -> None:
    if len(argv) == 3 and argv[1] == "side":
        import asyncio

        asyncio.run(side(Path(argv[2])))
        return
    if len(argv) != 2:
        raise SystemExit("usage: python -m bench.bench_pair BASE  (another checkout)")
    base_tree = Path(argv[1]).resolve()
    if turn_module(base_tree) is None:
        raise SystemExit(f"{base_tree} is no checkout with bench/bench_turn.py (or tests/)")
    n = counts(os.environ)
    sides: list[Side] = []
    rows: list[Paired] = []
    try:
        sides.append(Side(base_tree))
        sides.append(Side(HERE))
        for measure in MEASURES:
            got: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
            for i in range(n[measure]):
                for at in (0, 1) if i % 2 == 0 else (1, 0):
                    got[at].append(sides[at].order(measure))
                print(f"\r{measure} {i + 1}/{n[measure]}", end="", file=sys.stderr, flush=True)
            if n[measure]:
                print(file=sys.stderr)
                rows += summarize(measure, *got)
    finally:
        for started in sides:
            started.stop()
    print(table(rows, str(base_tree), str(HERE)))


if __name__ == "__main__":
    main(sys.argv)
