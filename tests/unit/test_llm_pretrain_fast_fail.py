"""A mistake in llm_pretrain.py's configuration is refused before torch is imported: one line and
exit 2 in a fraction of a second on every rank, not after each rank's ~3 CPU-s of torch (minutes
on thousands of ranks reading a shared file system). One process runs every case in turn, then
says whether torch was ever imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "layout": (["--tp", "4"], "cannot infer dp: tp(4) * pp(1) = 4 does not divide world size 1"),
    "batch": (["--global-batch", "6", "--micro-batch", "4"], "global batch 6 is not divisible by dp 1 x micro-batch 4"),
    "fpdt": (["--fpdt-chunk", "4", "--seq-len", "30"], "seq_len 30 is not divisible by cp 1 x fpdt_chunk 4 = 4"),
    "hpz": (["--hpz"], "hybrid sharding and hpZ shard parameters; set fsdp=True"),
    "moe": (["--moe-capacity", "1.5"], "--moe-capacity needs a MoE model"),
    "doc-mask": (["--doc-mask"], "--doc-mask needs --data"),
    "resume": (["--ckpt-dir", "{tmp}/none", "--resume"], "no checkpoint at {tmp}/none: the path does not exist"),
    "pop": (["--pop", "3"], "pop 3 does not divide 1 ranks: every member needs as many ranks"),
    "member": (["--member", '{"tp": 2}', "--member", '{"tp": 1}'], "2 members do not split 1 ranks evenly"),
    "saves": (["--ckpt-dir", "{tmp}/held"], "{tmp}/held already holds a 'latest' file from an earlier run"),
    "locked": (["--ckpt-dir", "{tmp}/locked"], "{tmp}/locked is being saved to by another job (pid "),
}

DRIVER = """
import contextlib, io, json, runpy, sys
main = runpy.run_path(sys.argv[1])["main"]
out = {}
for name, argv in json.loads(sys.argv[2]).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    out[name] = [rc, err.getvalue()]
out["torch imported"] = "torch" in sys.modules
print(json.dumps(out))
"""


def test_every_configuration_mistake_is_refused_before_torch_is_imported(tmp_path):
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "latest").write_text("step_00000004\n")  # an earlier run's pointer: not written over
    argvs = {k: [a.replace("{tmp}", str(tmp_path)) for a in argv] for k, (argv, _) in CASES.items()}
    script = str(ROOT / "workflows" / "llm_pretrain.py")
    (tmp_path / "locked").mkdir()  # another job saving there: its lock held by a live process
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from hpcml.ckpt import lock; "
                               "lock.hold(sys.argv[1]); print('held', flush=True); time.sleep(60)",
                               str(tmp_path / "locked")], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = subprocess.run([sys.executable, "-c", DRIVER, script, json.dumps(argvs)], capture_output=True,
                              text=True, cwd=ROOT, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (_, expected) in CASES.items():
        rc, err = got[name]
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, (name, rc, err)
        assert lines[0].startswith("llm_pretrain: error: ") and expected.replace("{tmp}", str(tmp_path)) in lines[0], \
            (name, lines[0])
    assert got["torch imported"] is False
    assert (tmp_path / "held" / "latest").read_text() == "step_00000004\n"
    assert sorted(p.name for p in (tmp_path / "locked").iterdir()) == [".hpcml-lock"]  # nothing saved
