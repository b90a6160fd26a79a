"""TransferQueue benchmark: this TransferQueue vs transferqueue 0.1.11 vs Ray's object store vs memcpy.

One invocation, one machine, one table (run from the repository root)::

    python bench/transfer_queue.py            # full run, a few minutes on 2 cores
    python bench/transfer_queue.py --quick    # fewer repetitions

Workload (from issue 3): samples of 4096 tokens, each token an int64 id plus two float32 values
(16 B/token): 64 samples = 4 MiB and 512 samples = 32 MiB per put/get. Producer and consumer always
run in separate processes; put and get are measured one after the other (not concurrently) and after a
warm-up round, so the figures are steady-state bandwidths. The metadata request is ``get_meta`` of 64
rows from a partition of 100,000 rows. Start-up is the time until a client can put.

The peer ``transferqueue==0.1.11`` runs only when importable; install it without replacing torch::

    pip install -c <(echo torch==2.13.0) transferqueue==0.1.11
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
# This file is named transfer_queue.py: drop its folder from the path, or ``import transfer_queue``
# would import this script instead of the peer package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _BENCH_DIR]
sys.path.insert(0, os.path.dirname(_BENCH_DIR))

MiB = 1 << 20
TOKENS = 4096
PEER_INSTALL = "pip install -c <(echo torch==2.13.0) transferqueue==0.1.11"
RAY_CPUS = 4  # logical CPUs for Ray: transferqueue's three actors reserve one CPU each


def make_batch(n: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(n)
    return {"ids": torch.randint(0, 150000, (n, TOKENS), generator=gen),
            "logp": torch.randn(n, TOKENS, generator=gen), "adv": torch.randn(n, TOKENS, generator=gen)}


def nbytes(batch: dict) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values())


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


# ----------------------------------------------------------------------------- this TransferQueue
def tq_worker(address: str, config, commands, results) -> None:
    """A producer or consumer process: runs commands from the driver and returns timings."""
    from asyncflow.transfer_queue import TransferQueueClient

    client = TransferQueueClient(address, config)
    batches: dict[int, dict] = {}
    while True:
        cmd, *args = commands.get()
        if cmd == "stop":
            break
        times = []
        if cmd == "put":
            part, n, reps = args
            batch = batches.setdefault(n, make_batch(n))
            for _ in range(reps):
                t0 = time.perf_counter()
                client.put(part, batch)
                times.append(time.perf_counter() - t0)
        elif cmd == "get":
            part, task, n, reps = args
            for _ in range(reps):
                t0 = time.perf_counter()
                out = client.get(part, task, ["ids", "logp", "adv"], n)
                times.append(time.perf_counter() - t0)
                assert len(out) == n
        elif cmd == "fill":
            part, rows = args
            import torch

            client.create_partition(part)
            for start in range(0, rows, 10000):
                client.put(part, {"x": torch.zeros(min(10000, rows - start), 1, dtype=torch.int64)})
        elif cmd == "meta":
            part, n, reps = args
            for i in range(reps):
                t0 = time.perf_counter()
                meta = client.get_meta(part, "meta", ["x"], n)
                times.append(time.perf_counter() - t0)
                assert len(meta) == n, i
        elif cmd == "rtt":
            for _ in range(args[0]):
                t0 = time.perf_counter()
                client._controller.request({"op": "hello"})
                times.append(time.perf_counter() - t0)
        elif cmd == "admin":
            op, part = args
            getattr(client, op)(part, **({"force": True} if op == "clear" else {}))
        results.put(times)
    client.close()


def bench_ours(sizes: dict[int, int], meta_rows: int, meta_reps: int) -> dict:
    from asyncflow.transfer_queue import TransferQueueConfig, start

    out = {}
    startups = []
    for _ in range(3):
        t0 = time.perf_counter()
        dep = start(TransferQueueConfig(deployment="processes", storage_unit_capacity_bytes=64 * MiB))
        with dep.client() as c:
            c.create_partition("s")
            c.put("s", {"x": make_batch(1)["ids"]})
        startups.append(time.perf_counter() - t0)
        dep.shutdown()
    out["startup"] = statistics.median(startups)

    config = TransferQueueConfig(deployment="processes", storage_unit_capacity_bytes=2048 * MiB)
    dep = start(config)
    ctx = mp.get_context("spawn")
    queues = {role: (ctx.Queue(), ctx.Queue()) for role in ("producer", "consumer")}
    procs = [ctx.Process(target=tq_worker, args=(dep.address, dep.config, *queues[role]), daemon=True)
             for role in queues]
    for p in procs:
        p.start()

    def run(role, *cmd):
        queues[role][0].put(cmd)
        return queues[role][1].get(timeout=600)

    try:
        for n, reps in sizes.items():
            size = nbytes(make_batch(n)) / MiB
            part = f"bw{n}"
            run("producer", "fill", part, 0)
            for phase in ("warm", "timed"):  # warm: arena pages get mapped once in both processes
                puts = run("producer", "put", part, n, reps)
                gets = run("consumer", "get", part, f"reader-{phase}", n, reps)
                run("producer", "admin", "clear", part)
                run("producer", "fill", part, 0)
            out[f"put{n}"] = size / statistics.median(puts)
            out[f"get{n}"] = size / statistics.median(gets)
            run("producer", "admin", "clear", part)
        run("producer", "fill", "meta", meta_rows)
        run("consumer", "meta", "meta", 64, 50)  # warm-up
        lat = run("consumer", "meta", "meta", 64, meta_reps)
        out["meta_p50"], out["meta_p99"] = pct(lat, 50) * 1e3, pct(lat, 99) * 1e3
        rtt = run("consumer", "rtt", 2000)
        out["rtt_p50"] = pct(rtt, 50) * 1e3
    finally:
        for role in queues:
            queues[role][0].put(("stop",))
        for p in procs:
            p.join(30)
        dep.shutdown()
    return out


# ----------------------------------------------------------------------------- Ray object store
def bench_ray(sizes: dict[int, int]) -> dict:
    import ray

    @ray.remote(num_cpus=0)
    class Producer:
        def put(self, n, reps):
            batch = make_batch(n)
            refs, times = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                refs.append(ray.put(batch))
                times.append(time.perf_counter() - t0)
            return times, refs

    @ray.remote(num_cpus=0)
    class Consumer:
        def get(self, refs):
            times = []
            for ref in refs:
                t0 = time.perf_counter()
                ray.get(ref)
                times.append(time.perf_counter() - t0)
            return times

    producer, consumer = Producer.remote(), Consumer.remote()
    out = {}
    for n, reps in sizes.items():
        size = nbytes(make_batch(n)) / MiB
        for _ in ("warm", "timed"):
            puts, refs = ray.get(producer.put.remote(n, reps))
            gets = ray.get(consumer.get.remote(refs))
            del refs
        out[f"put{n}"] = size / statistics.median(puts)
        out[f"get{n}"] = size / statistics.median(gets)
    ray.kill(producer)
    ray.kill(consumer)
    return out


# ----------------------------------------------------------------------------- transferqueue 0.1.11
def bench_peer(sizes: dict[int, int], meta_rows: int, meta_reps: int) -> dict:
    import ray
    import transfer_queue as peer

    out = {}
    t0 = time.perf_counter()
    peer.init()  # starts its controller and storage actors on the running Ray cluster
    out["startup_ray_running"] = time.perf_counter() - t0

    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self):
            sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _BENCH_DIR]
            sys.modules.pop("transfer_queue", None)
            import transfer_queue

            transfer_queue.init()  # attaches to the existing controller
            self.client = transfer_queue.get_client()

        def put(self, part, n, reps):
            from tensordict import TensorDict

            batch = TensorDict(make_batch(n), batch_size=[n])
            times = []
            for rep in range(reps):
                t0 = time.perf_counter()
                self.client.put(data=batch, partition_id=f"{part}-{rep}")
                times.append(time.perf_counter() - t0)
            return times

        def get(self, part, n, reps):
            times = []
            for rep in range(reps):
                t0 = time.perf_counter()
                meta = self.client.get_meta(data_fields=["ids", "logp", "adv"], batch_size=n,
                                            partition_id=f"{part}-{rep}", task_name="bench")
                self.client.get_data(meta)
                times.append(time.perf_counter() - t0)
            return times

        def clear(self, part, reps):
            for rep in range(reps):
                self.client.clear_partition(f"{part}-{rep}")

        def fill(self, part, rows):
            import torch
            from tensordict import TensorDict

            column = torch.zeros(rows, 1, dtype=torch.int64)
            self.client.put(data=TensorDict({"x": column}, batch_size=[rows]), partition_id=part)

        def meta(self, part, n, reps):
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                self.client.get_meta(data_fields=["x"], batch_size=n, partition_id=part, task_name="meta")
                times.append(time.perf_counter() - t0)
            return times

    producer, consumer = Worker.remote(), Worker.remote()
    for n, reps in sizes.items():
        size = nbytes(make_batch(n)) / MiB
        for phase in ("warm", "timed"):
            puts = ray.get(producer.put.remote(f"bw{n}{phase}", n, reps), timeout=600)
            gets = ray.get(consumer.get.remote(f"bw{n}{phase}", n, reps), timeout=600)
            ray.get(producer.clear.remote(f"bw{n}{phase}", reps), timeout=600)
        out[f"put{n}"] = size / statistics.median(puts)
        out[f"get{n}"] = size / statistics.median(gets)
    ray.get(producer.fill.remote("meta", meta_rows), timeout=600)
    ray.get(consumer.meta.remote("meta", 64, 20), timeout=600)
    lat = ray.get(consumer.meta.remote("meta", 64, meta_reps), timeout=600)
    out["meta_p50"], out["meta_p99"] = pct(lat, 50) * 1e3, pct(lat, 99) * 1e3
    ray.kill(producer)
    ray.kill(consumer)
    peer.close()
    return out


def bench_peer_startup_cold() -> float:
    """transferqueue's ``init`` as a user sees it on a fresh process: it starts Ray itself."""
    import subprocess

    # Its controller and each storage unit reserve 1 CPU: on a 2-core machine Ray must be started with
    # more logical CPUs first, or init waits forever for its placement group.
    code = ("import os, time; t0 = time.perf_counter(); import ray; ray.init(address=\"local\", num_cpus=RAY_CPUS, "
            "include_dashboard=False); import transfer_queue as tq; tq.init(); "
            "print(time.perf_counter() - t0, flush=True); os._exit(0)").replace("RAY_CPUS", str(RAY_CPUS))
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                              start_new_session=True)
        return float(proc.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return "failed"


# ----------------------------------------------------------------------------- memcpy
def bench_memcpy(sizes: dict[int, int]) -> dict:
    import torch

    torch.set_num_threads(2)
    out = {}
    for n in sizes:
        size = nbytes(make_batch(n))
        # Rotate over 256 MiB of buffers so that every copy streams from and to DRAM, as the data
        # plane's copies do, instead of measuring a copy that stays in cache.
        pairs = max(1, (256 * MiB) // (2 * size))
        bufs = [(torch.randn(size // 4), torch.empty(size // 4)) for _ in range(pairs)]
        for src, dst in bufs:
            dst.copy_(src)
        times = []
        for i in range(max(50, pairs)):
            src, dst = bufs[i % pairs]
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        # The physical limit: the best copy observed (a median would mostly measure other jobs' load).
        out[f"copy{n}"] = size / MiB / min(times)
    return out


# ----------------------------------------------------------------------------- report
def fmt(value, digits: int = 0) -> str:
    if isinstance(value, str):
        return value
    return "-" if value is None else f"{value:,.{digits}f}"


def ratio(a, b, higher_is_better: bool = True) -> str:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not a or not b:
        return "-"
    return f"{(a / b if higher_is_better else b / a):.1f}x"


def report(sizes, ours, peer, ray_res, memcpy) -> None:
    rows = []
    for n in sizes:
        mib = n * TOKENS * 16 / MiB
        for op in ("put", "get"):
            key = f"{op}{n}"
            rows.append((f"{op} {n} x {TOKENS} tok ({mib:.0f} MiB), MiB/s", ours.get(key), peer.get(key),
                         ray_res.get(key), memcpy.get(f"copy{n}"), True, 0))
    rows.append(("get_meta 64 rows of 100k, p50 ms", ours.get("meta_p50"), peer.get("meta_p50"), None, None,
                 False, 3))
    rows.append(("get_meta 64 rows of 100k, p99 ms", ours.get("meta_p99"), peer.get("meta_p99"), None, None,
                 False, 3))
    rows.append(("start-up until first put, s", ours.get("startup"), peer.get("startup_cold"), None, None,
                 False, 2))
    header = ("metric", "this TQ", "transferqueue 0.1.11", "Ray object store", "memcpy",
              "vs transferqueue", "vs Ray", "of memcpy")
    table = [header]
    for name, a, b, c, d, higher, digits in rows:
        of_memcpy = f"{100 * a / d:.0f}%" if isinstance(a, float) and isinstance(d, float) else "-"
        table.append((name, fmt(a, digits), fmt(b, digits), fmt(c, digits), fmt(d, digits),
                      ratio(a, b, higher), ratio(a, c, higher), of_memcpy))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(r, widths)) + " |" for r in table]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    print("\n".join(lines))
    rtt = ours.get("rtt_p50", 0.0)
    print(f"\nControl round trip of this TQ (hello, the floor of any request): p50 {rtt:.3f} ms. "
          "Ratios: higher is better for this TQ (for latencies and start-up, the peer's time / ours).")
    if isinstance(peer.get("startup_ray_running"), float):
        print(f"transferqueue init with Ray already running: {peer['startup_ray_running']:.2f} s "
              "(the table's start-up includes starting Ray, which its init does by itself).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--no-peer", action="store_true", help="skip transferqueue 0.1.11")
    parser.add_argument("--no-ray", action="store_true", help="skip Ray's object store")
    args = parser.parse_args()
    sizes = {64: 10, 512: 3} if args.quick else {64: 30, 512: 8}
    meta_reps = 300 if args.quick else 1000
    memcpy = bench_memcpy(sizes)
    print("memcpy done", flush=True)
    ours = bench_ours(sizes, 100_000, meta_reps)
    print("this TransferQueue done", flush=True)
    ray_res: dict = {}
    peer: dict = {}
    try:
        import transfer_queue  # noqa: F401

        have_peer = not args.no_peer
    except ImportError:
        have_peer = False
        if not args.no_peer:
            peer = {k: f"not installed: {PEER_INSTALL}" for k in ("put64",)}
    if have_peer:
        peer["startup_cold"] = bench_peer_startup_cold()
    if not args.no_ray or have_peer:
        import ray

        ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)
        try:
            if not args.no_ray:
                ray_res = bench_ray(sizes)
                print("Ray object store done", flush=True)
            if have_peer:
                try:
                    peer.update(bench_peer(sizes, 100_000, min(meta_reps, 300)))
                    print("transferqueue 0.1.11 done", flush=True)
                except Exception as exc:  # report the peer's failure in the table instead of crashing
                    print(f"transferqueue 0.1.11 failed: {exc!r}", flush=True)
                    peer.setdefault("put64", f"failed: {type(exc).__name__}")
        finally:
            ray.shutdown()
    again = bench_memcpy(sizes)  # once more at the end: keep the better of the two
    memcpy = {k: max(v, again[k]) for k, v in memcpy.items()}
    print()
    report(sizes, ours, peer, ray_res, memcpy)


if __name__ == "__main__":
    main()
