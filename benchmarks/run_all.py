"""Run the benchmark suite: `make bench` (full) or `make bench-quick` (a smoke run).

Each script writes benchmarks/results/<name>.json (quick runs: <name>-quick.json,
not committed) and prints its table. A full run also regenerates the README's
"Performance" section from the JSON files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpoint  # noqa: E402
import common  # noqa: E402
import core_overhead  # noqa: E402
import cost_model  # noqa: E402
import cpu_split  # noqa: E402
import cuda_copy  # noqa: E402
import interference  # noqa: E402
import learner_loop  # noqa: E402
import learner_overhead  # noqa: E402
import packing  # noqa: E402
import readme_perf  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: <name>-quick.json")
    ap.add_argument("--device", default="cpu", type=common.device_argument,
                    help="where the learner loop's learner runs: cpu (default) or cuda")
    args = ap.parse_args(argv)
    common.steady_malloc()  # one allocator mode for every benchmark of the suite
    core_overhead.main(args.quick)
    packing.main(args.quick)
    learner_overhead.main(args.quick)
    learner_loop.main(args.quick, args.device)
    cpu_split.main(args.quick)
    interference.main(args.quick)
    cost_model.main(args.quick)
    checkpoint.main(args.quick)
    cuda_copy.main(args.quick)
    if not args.quick:
        readme_perf.update(HERE.parent / "README.md")
        print("README performance section regenerated from", HERE / "results")
    print(json.dumps({"quick": args.quick, "results": str(HERE / "results")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
