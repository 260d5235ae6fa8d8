"""What the file layer costs (issue 40): hpcml's guarded reads and appends of run-directory
files against the plain ``open()`` + ``json.loads`` they replaced, and the bytes as fast as the
page cache gives them (the limit), side by side in one run.

    python benchmarks/safeio_cost.py --json            # 100,000 provenance lines, a 20 MB done record

Provenance: ``provenance.completed_sims`` (``safeio.iter_lines`` + a depth-bounded parse per line)
over 100,000 lines of ~410 bytes (a campaign of 10^5 members), against a plain ``for line in
open()`` + ``json.loads``. A done record: ``contract.read_json`` (size and blocks checked, one
pass over its brackets, then parsed) against ``json.loads(open().read())``. Appends:
``provenance.append_provenance`` of one record (open without following links, check, write,
close) against a plain ``open(..., "a")``. Limit: ``read()`` of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--lines", type=int, default=100_000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    from hpcml import contract
    from hpcml.ensemble import provenance

    with tempfile.TemporaryDirectory() as d:
        run = Path(d)
        rec = {"sim_id": 0, "attempt": 0, "params": {"a": 0.25, "b": 1.5}, "status": "ok", "returncode": 0,
               "signal": None, "samples_sent": 16, "result": {"samples_sent": 16}, "streamed": 16,
               "start": 1.8e9, "end": 1.8e9 + 3.5, "duration_s": 3.5, "host": "nid001234", "launch": "srun -n 2",
               "argv": ["python", "-m", "my_sim", "--steps", "100"], "command": "srun -n 2 python -m my_sim",
               "stdout": "sims/sim_00000/attempt_0.out", "stderr": "sims/sim_00000/attempt_0.err"}
        prov = run / provenance.PROVENANCE_FILE
        prov.write_text("".join(json.dumps({**rec, "sim_id": i}) + "\n" for i in range(args.lines)))
        done = run / "sims_done.json"
        n = 10**6
        done.write_text(json.dumps({"campaign": "c", "run": "r", "completed": list(range(n)), "failed": [],
                                    "streamed": {str(i): 16 for i in range(0, n, 4)}}))

        def plain_prov():
            with open(prov) as f:
                return {r["sim_id"] for r in map(json.loads, f) if r.get("status") == "ok"}

        assert set(provenance.completed_sims(run)) == plain_prov()  # the same answer, or the timing means nothing
        safe_prov = _best(lambda: provenance.completed_sims(run), args.repeat)
        plain_p = _best(plain_prov, args.repeat)
        read_p = _best(lambda: prov.read_bytes(), args.repeat)
        safe_done = _best(lambda: contract.read_json(done), args.repeat)
        plain_done = _best(lambda: json.loads(open(done).read()), args.repeat)
        k = 2000
        line = [{**rec, "sim_id": -1}]
        safe_app = _best(lambda: [provenance.append_provenance(run, line) for _ in range(k)], args.repeat) / k

        def plain_append():
            for _ in range(k):
                with open(prov, "a") as f:
                    f.write(json.dumps(line[0]) + "\n")
        plain_app = _best(plain_append, args.repeat) / k
        mb_prov, mb_done = prov.stat().st_size / 1e6, done.stat().st_size / 1e6
    out = {"benchmark": "safeio_cost", "provenance_lines": args.lines, "provenance_mb": round(mb_prov, 1),
           "provenance_safe_s": safe_prov, "provenance_plain_s": plain_p, "provenance_read_limit_s": read_p,
           "provenance_safe_over_plain": safe_prov / plain_p, "done_record_mb": round(mb_done, 1),
           "done_safe_s": safe_done, "done_plain_s": plain_done, "done_safe_over_plain": safe_done / plain_done,
           "append_safe_us": safe_app * 1e6, "append_plain_us": plain_app * 1e6,
           "append_safe_over_plain": safe_app / plain_app}
    for key, v in out.items():
        print(f"{key:<28} {v:.4g}" if isinstance(v, float) else f"{key:<28} {v}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
