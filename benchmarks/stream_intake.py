"""Streaming intake vs raw ZeroMQ vs the file path, and online vs offline training, in one run.

    python benchmarks/stream_intake.py --json                  # 1 MiB messages, then both workflows
    python benchmarks/stream_intake.py --json --nx 1024 --no-workflow

Intake: one producer process (a simulation rank: hpcml.stream.Producer, one copy per message) sends
``--messages`` samples of one float32 field [nx, ny] over loopback to a StreamServer thread (challenge
per connection, validate, assemble, dedup) whose FIFO buffer a consumer thread drains, as a trainer
would; ``stream_sealed`` is the same with ``integrity="message"`` (a GMAC on every message, both sides).
Peer: raw ZeroMQ PUSH -> PULL of the same message size and count between the same two processes, nothing
else; ``raw_zmq_held`` is the same with each message kept as a sample in the stream's FIFO buffer that
the same consumer drains (a trainer's work: the plain peer drops each message at once). Limit: loopback
TCP of the same bytes (``sendall`` of each message, ``recv_into`` one buffer allocated once:
``tcp_limit_mb_s``). File path: the same samples written to one HDF5 file (fsync) and
read back into a buffer (page cache dropped where allowed) -- what an offline pipeline pays per byte.
Both wires run: the default framed one (plain TCP, a challenge per connection, every byte a connection
makes the server hold bounded) and the opt-in ``transport="zmtp"`` (ZeroMQ's own messages, for trusted
simulations). CPU per MiB of each side, every thread of its process, is reported beside the rates.
Workflow: ``workflows/heat_surrogate.py`` online and offline at equal gradient steps: held-out error and
the trainer's idle fraction.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _producer(kind: str, endpoint: str, n: int, nx: int, ny: int, key_file: str) -> None:
    """Child process: send n messages (raw zmq or hpcml Producer)."""
    import zmq

    from hpcml.stream import Producer, read_secret  # imported before the clock starts, as zmq is

    field = np.random.default_rng(0).random((nx, ny), dtype=np.float32)
    cpu0 = time.process_time()  # the sending alone (every thread of this process), not the start-up
    if kind == "tcp":
        import socket

        host, port = endpoint.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            for i in range(n):
                s.sendall(field.copy())
        print(json.dumps({"cpu_s": time.process_time() - cpu0}), flush=True)
        return
    if kind == "raw":
        ctx = zmq.Context()
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, 4)
        s.connect(endpoint)
        for i in range(n):
            s.send(field.copy(), copy=False)
        s.send(b"")
        s.close(linger=-1)
        ctx.term()  # before `field` is freed: zero-copy frames are still being sent
        print(json.dumps({"cpu_s": time.process_time() - cpu0}), flush=True)
        return
    p = Producer(endpoint=endpoint, secret=read_secret(key_file), campaign="bench", sim_id=0, attempt=0, rank=0,
                 nranks=1, params={"a": 1.0}, global_shape=(nx, ny), offset=(0, 0), local_shape=(nx, ny), copy=False)
    for i in range(n):  # as a kernel does: a fresh float32 copy of its state per output
        p.send(i, float(i), {"T": field.copy()})
    p.close()
    print(json.dumps({"cpu_s": time.process_time() - cpu0}), flush=True)


def _cpu(proc: subprocess.Popen, r0: resource.struct_rusage, n: int) -> dict:
    """CPU ms a message: the sender's (as it reported it) and this process's since ``r0``, every
    thread, and the receiver's split into user (Python, libzmq) and kernel (system calls, copies)."""
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    user, kernel = (r1.ru_utime - r0.ru_utime) * 1e3 / n, (r1.ru_stime - r0.ru_stime) * 1e3 / n
    return {"sender_ms": _cpu_of(proc) * 1e3 / n, "receiver_ms": user + kernel, "receiver_user_ms": user,
            "receiver_kernel_ms": kernel}


def _ratio(a: float, b: float) -> float | None:
    """``a / b``; None when ``b`` is 0 (a side whose CPU time the clock's tick did not see)."""
    return a / b if b else None


def _cpu_of(proc: subprocess.Popen) -> float:
    """Wait for ``proc``; the CPU seconds of its sending (every thread), as it reported them."""
    out, _ = proc.communicate()
    return json.loads(out.strip().splitlines()[-1])["cpu_s"]


def spawn(kind: str, endpoint: str, args, key_file: str) -> subprocess.Popen:
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.stream_intake import _producer; "
            f"_producer({kind!r}, {endpoint!r}, {args.messages}, {args.nx}, {args.ny}, {key_file!r})")
    pin = ["taskset", "-c", "0"] if args.pin else []  # the sender on CPU 0, this process on CPU 1
    return subprocess.Popen([*pin, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def raw_zmq(args, key_file, held: bool = False) -> tuple[float, dict]:
    """Raw ZeroMQ PUSH -> PULL. ``held``: each message kept, as a trainer keeps a sample, in the
    stream's own FIFO buffer (a view of ZeroMQ's frame, no copy) that the same consumer drains --
    the work a receiver that hands samples to training cannot skip; the plain peer drops each
    message as it arrives, so the next lands in memory still in the cache."""
    import zmq

    from hpcml.stream import Buffer, BufferConfig
    from hpcml.stream.buffer import Sample

    s = zmq.Context.instance().socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, 8)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    buf = Buffer(BufferConfig(policy="fifo", capacity=16, watermark=1)) if held else None
    params = np.zeros(1, np.float32)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    th = _consumer(buf, args.messages) if held else None
    proc = spawn("raw", f"tcp://127.0.0.1:{port}", args, key_file)
    nbytes, t0, i = 0, None, 0
    while True:
        m = s.recv(copy=False)
        if t0 is None:
            t0 = time.perf_counter()
            nbytes -= len(m.buffer)  # count from the first arrival: the same for both paths
        if not len(m.buffer):
            break
        nbytes += len(m.buffer)
        if held:
            fields = np.frombuffer(m.buffer, np.float32).reshape(1, args.nx, args.ny)
            sample, i = Sample(0, i, float(i), params, fields), i + 1
            while not buf.put(sample, timeout=0.05):
                pass
    if th is not None:
        th.join()
    dt = (th.last if th is not None else time.perf_counter()) - t0
    cpu = _cpu(proc, cpu0, args.messages)
    s.close()
    return nbytes / 1e6 / dt, cpu


def _consumer(buf, n: int):
    """A thread draining ``buf`` as a trainer does (batches of 8) until ``n`` samples are taken;
    ``.taken`` counts them, ``.last`` is when the last came."""
    import threading

    def consume():
        while th.taken < n:
            b = buf.get(min(8, n - th.taken), timeout=0.1)
            if b:
                th.taken += len(b)
                th.last = time.perf_counter()
    th = threading.Thread(target=consume)
    th.taken, th.last = 0, 0.0
    th.start()
    return th


def tcp_limit(args, key_file) -> tuple[float, dict]:
    """Loopback TCP of the same bytes: one ``recv_into`` per arrival into a buffer allocated once."""
    import socket

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    proc = spawn("tcp", f"127.0.0.1:{lsock.getsockname()[1]}", args, key_file)
    conn, _ = lsock.accept()
    msg = args.nx * args.ny * 4
    total, got, t0 = msg * args.messages, 0, None
    buf = memoryview(bytearray(msg))
    while got < total:
        n = conn.recv_into(buf[:min(msg, total - got)])
        if not n:
            break
        if t0 is None:
            t0 = time.perf_counter()
            total -= msg  # count from the first arrival, as for the other paths
            got -= msg
        got += n
    dt = time.perf_counter() - t0
    cpu = _cpu(proc, cpu0, args.messages)
    conn.close()
    lsock.close()
    return total / 1e6 / dt, cpu


def hpcml_stream(args, key_file, kind: str = "hpcml") -> tuple[float, float, dict, dict]:
    from hpcml.stream import Buffer, BufferConfig, read_secret
    from hpcml.stream.server import ServerConfig, StreamServer

    buf = Buffer(BufferConfig(policy="fifo", capacity=16, watermark=1))
    srv = StreamServer(campaign="bench", secret=read_secret(key_file), rank=0, n_trainers=1, buffer=buf,
                       config=ServerConfig(param_names=("a",), field_names=("T",),
                                           transport="zmtp" if kind == "hpcml-zmtp" else "framed",
                                           integrity="message" if kind == "hpcml-sealed" else "connection")).start()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)  # from a listening server to the last sample taken, as for raw
    # ZeroMQ
    th = _consumer(buf, args.messages)  # as a trainer: batches of 8
    proc = spawn(kind, srv.endpoint, args, key_file)
    th.join()
    cpu = _cpu(proc, cpu0, args.messages)
    stats = srv.stats()
    srv.stop()
    msg = args.nx * args.ny * 4
    dt = th.last - srv.t_first  # first arrival to the last sample in a trainer's hands, as for raw ZeroMQ
    return msg * (th.taken - 1) / 1e6 / dt, (th.taken - 1) / dt, stats, cpu


def file_path(args, tmp: Path) -> tuple[float, float, float]:
    import h5py

    from hpcml.stream import Buffer, BufferConfig
    from hpcml.stream.files import FileSource

    field = np.random.default_rng(0).random((args.nx, args.ny), dtype=np.float32)
    path = tmp / "sim_00000.h5"
    t0 = time.perf_counter()
    with h5py.File(path, "w") as f:  # the kernels' layout (docs/kernels.md), written step by step
        ds = f.create_dataset("fields/T", (args.messages, args.nx, args.ny), np.float32)
        for i in range(args.messages):
            ds[i] = field
        f["step"] = np.arange(args.messages)
        f["time"] = np.arange(args.messages, dtype=np.float64)
        f.attrs["params"] = json.dumps({"a": 1.0})
        f.attrs["sim_id"] = 0
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    write_s = time.perf_counter() - t0
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass
    buf = Buffer(BufferConfig(policy="fifo", capacity=args.messages, watermark=1))
    t0 = time.perf_counter()
    FileSource([path], rank=0, n_trainers=1, buffer=buf, field_names=("T",), param_names=("a",))._run()
    read_s = time.perf_counter() - t0
    assert len(buf) == args.messages
    nbytes = args.messages * field.nbytes
    return nbytes / 1e6 / (write_s + read_s), nbytes / 1e6 / write_s, nbytes / 1e6 / read_s


def workflow(args, mode: str, tmp: Path) -> dict:
    run = tmp / f"wf_{mode}"
    cmd = [sys.executable, str(ROOT / "workflows" / "heat_surrogate.py"), "--mode", mode, "--run-dir", str(run),
           "--sims", str(args.sims), "--steps", str(args.steps), "--no-report", "--quiet"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads((run / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nx", type=int, default=512)
    p.add_argument("--ny", type=int, default=512)
    p.add_argument("--messages", type=int, default=400)
    p.add_argument("--repeat", type=int, default=3, help="intake measurements (best of)")
    p.add_argument("--sims", type=int, default=16)
    p.add_argument("--steps", type=int, default=1500, help="gradient steps of both workflow runs (the demo's)")
    p.add_argument("--no-workflow", action="store_true")
    p.add_argument("--pin", action="store_true", help="sender on CPU 0, receiver on CPU 1: as on two nodes, each "
                                                     "side a core of its own")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.pin:
        os.sched_setaffinity(0, {1})
    from hpcml.stream import new_secret

    with tempfile.TemporaryDirectory(prefix="hpcml-stream-bench-") as d:
        tmp = Path(d)
        key = str(tmp / "k")
        new_secret(key)
        raws, held, runs, sealed, zmtp, tcps = [], [], [], [], [], []
        for _ in range(args.repeat):  # in turns: each sees the same load on the 2 cores
            tcps.append(tcp_limit(args, key))
            raws.append(raw_zmq(args, key))
            held.append(raw_zmq(args, key, held=True))
            runs.append(hpcml_stream(args, key))
            sealed.append(hpcml_stream(args, key, "hpcml-sealed"))
            zmtp.append(hpcml_stream(args, key, "hpcml-zmtp"))
        raw = max(r[0] for r in raws)
        mb, sps, stats, _ = max(runs, key=lambda r: r[0])
        paired = sorted(r[0] / w[0] for r, w in zip(runs, raws))
        sides = ("sender_ms", "receiver_ms", "receiver_user_ms", "receiver_kernel_ms")
        cpu = {name: {side: float(np.median([c[-1][side] for c in rs])) for side in sides}
               for name, rs in (("raw_zmq", raws), ("raw_zmq_held", held), ("stream", runs), ("stream_sealed", sealed),
                                ("stream_zmtp", zmtp), ("tcp_limit", tcps))}
        mib = args.nx * args.ny * 4 / 2**20
        cpu_mib = {name: {side.replace("_ms", "_ms_per_mib"): v / mib for side, v in c.items()}
                   for name, c in cpu.items()}
        tcp = max(r[0] for r in tcps)
        fmb, fw, fr = file_path(args, tmp)
        out = {"benchmark": "stream_intake", "msg_bytes": args.nx * args.ny * 4, "messages": args.messages,
               "stream_mb_s": mb, "stream_samples_s": sps, "zmq_raw_mb_s": raw, "tcp_limit_mb_s": tcp,
               "file_path_mb_s": fmb, "tcp_limit_mb_s_runs": [r[0] for r in tcps],
               "file_write_mb_s": fw, "file_read_mb_s": fr, "stream_dropped": stats["dropped"],
               "zmq_raw_held_mb_s": max(r[0] for r in held),
               "stream_mb_s_runs": [r[0] for r in runs], "zmq_raw_mb_s_runs": [r[0] for r in raws],
               "zmq_raw_held_mb_s_runs": [r[0] for r in held],
               "stream_sealed_mb_s_runs": [r[0] for r in sealed], "stream_zmtp_mb_s_runs": [r[0] for r in zmtp],
               "cpu_per_message_ms": cpu, "cpu_per_mib_ms": cpu_mib,
               "receiver_cpu_per_mib_vs_raw_zmq": cpu["stream"]["receiver_ms"] / cpu["raw_zmq"]["receiver_ms"],
               "receiver_cpu_per_mib_vs_raw_zmq_held":
                   cpu["stream"]["receiver_ms"] / cpu["raw_zmq_held"]["receiver_ms"],
               "raw_zmq_held_cpu_vs_raw_zmq": cpu["raw_zmq_held"]["receiver_ms"] / cpu["raw_zmq"]["receiver_ms"],
               "receiver_user_and_kernel_vs_raw_zmq": [_ratio(cpu["stream"][k], cpu["raw_zmq"][k])
                                                       for k in ("receiver_user_ms", "receiver_kernel_ms")],
               "cpu_bound_ratio": sum(cpu["raw_zmq"][k] for k in sides[:2]) / sum(cpu["stream"][k] for k in sides[:2]),
               "ratios": {"stream_vs_raw_zmq": mb / raw, "stream_vs_raw_zmq_paired_median": paired[len(paired) // 2],
                          "stream_vs_tcp_limit": mb / tcp, "zmq_raw_vs_tcp_limit": raw / tcp,
                          "stream_vs_raw_zmq_paired": paired, "stream_vs_file_path": mb / fmb,
                          "stream_vs_raw_zmq_held_paired_median": sorted(r[0] / h[0] for r, h in zip(runs, held))[
                              len(held) // 2],
                          "sealed_vs_raw_zmq": max(r[0] for r in sealed) / raw,
                          "sealed_vs_raw_zmq_paired_median": sorted(z[0] / w[0] for z, w in zip(sealed, raws))[
                              len(raws) // 2],
                          "zmtp_vs_raw_zmq": max(r[0] for r in zmtp) / raw,
                          "zmtp_vs_raw_zmq_paired_median": sorted(z[0] / w[0] for z, w in zip(zmtp, raws))[
                              len(raws) // 2]}}
        if not args.no_workflow:
            on, off = workflow(args, "online", tmp), workflow(args, "offline", tmp)
            out.update({"trainer_idle_fraction": on["trainer_idle_fraction"], "online_val_rel_l2": on["val_rel_l2"],
                        "offline_val_rel_l2": off["val_rel_l2"], "gradient_steps": [on["gradient_steps"],
                                                                                     off["gradient_steps"]],
                        "online_wall_s": on["wall_s"], "offline_wall_s": off["wall_s"],
                        "online_samples_ingested": on["samples_ingested"],
                        "online_samples_missing": on["samples_missing"],
                        "online_agreement_fraction": on["agreement_fraction"],
                        "online_duplicate_samples": on["duplicate_samples"]})
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
