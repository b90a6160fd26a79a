"""TransferQueue load test: many producer and consumer processes, injected faults, one table.

    python bench/tq_load.py                 # 8 producers, 32 consumers, 5 tasks, 32k-row stream
    python bench/tq_load.py --smoke         # small sizes (the slow test runs this)

Phase 1, stream: producer processes put rows (every row carries the CRC32 of its bytes) into one sealed
stream partition; consumer processes of five tasks read every row with different samplers (sequential,
group, data-parallel ranks, token-balanced across DP ranks, version). Meanwhile: a consumer takes a batch
and is SIGKILLed before reading it (its rows must come back through the lease); a producer is SIGKILLed
between prepare and commit (its put must be rolled back, nothing corrupted); one producer and one consumer
send every request twice, the copy one request late (duplicated and delayed messages).
Phase 2, storage unit: a unit holding rows is SIGKILLed and restarted; rows elsewhere stay readable and
intact, the lost ones are reported, new rows land on the new incarnation and read back intact.
Phase 3, latency: get_meta p50/p99 with 1, 64 and 256 parked consumers, on partitions of 10k and 1M rows.
Last, the controller's own CPU per request, measured in-process (the basis of the 1,000-client estimate).

Every received row is checked against its CRC, and every task must receive every row exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STREAM = "stream"
GROUP = 8
TASKS = {  # task -> (sampler, sampler args, data-parallel: its processes are the DP ranks of one replica set)
    "seq": ("sequential", None, False),
    "grpo": ("group", {"group_size": GROUP}, False),
    "dp": ("sequential", None, True),
    "balanced": ("token_balanced", None, True),
    "version": ("version", {"current_version": 1 << 30}, False),
}


def row_payload(producer: int, seq: int):
    import torch

    gen = torch.Generator().manual_seed(producer * 1_000_003 + seq)
    return torch.randint(0, 50000, (int(torch.randint(8, 256, (1,), generator=gen)),), generator=gen)


def crc(tokens) -> int:
    return zlib.crc32(tokens.numpy().tobytes())


class ChaosConnection:
    """Wraps a client's controller connection: every request goes out twice, the copy one request late."""

    def __init__(self, conn):
        self._conn, self._last = conn, None

    def send(self, header, buffers=()):
        req_id = self._conn.send(header, buffers)
        if self._last is not None:
            self._conn.send(*self._last)  # the previous request again, late (its reply is dropped)
        self._last = (header, buffers)
        return req_id

    def __getattr__(self, name):
        return getattr(self._conn, name)

    def request(self, header, buffers=(), timeout_s=60.0):
        return self._conn.recv(self.send(header, buffers), timeout_s, header.get("op", ""))


def client_for(address, config, chaos=False):
    from asyncflow.transfer_queue import TransferQueueClient

    client = TransferQueueClient(address, config)
    if chaos:
        client._controller = ChaosConnection(client._controller)
    return client


def producer(address, config, pid, rows, chaos):
    with client_for(address, config, chaos) as client:
        for start in range(0, rows, GROUP * 4):
            seqs = range(start, min(start + GROUP * 4, rows))
            toks = [row_payload(pid, s) for s in seqs]
            meta = [{"p": pid, "s": s, "crc": crc(t)} for s, t in zip(seqs, toks)]
            client.put(STREAM, {"tokens": toks, "meta": meta}, versions=[pid] * len(seqs),
                       group_ids=[pid * 1_000_000 + s // GROUP for s in seqs])


def consumer(address, config, task, dp_rank, dp_size, out_path, chaos):
    sampler, args, _ = TASKS[task]
    keys, bad = [], 0
    with client_for(address, config, chaos) as client:
        for batch in client.iter_batches(STREAM, task, ["tokens", "meta"], 64, sampler=sampler,
                                         sampler_args=args, dp_rank=dp_rank, dp_size=dp_size, timeout=300):
            for t, m in zip(batch["tokens"], batch["meta"]):
                keys.append((m["p"], m["s"]))
                bad += crc(t) != m["crc"]
    with open(out_path, "w") as f:
        json.dump({"keys": keys, "bad": bad}, f)


def victim_consumer(address, config, ready):
    """Takes a batch and never reads it: killed while holding it."""
    with client_for(address, config) as client:
        meta = client.get_meta(STREAM, "seq", ["tokens", "meta"], 64, timeout=300)
        ready.put(("victim", len(meta.indexes)))
        time.sleep(3600)


def dying_producer(address, config, ready):
    """Prepares a put, writes half of it, and is killed before the commit."""
    import torch

    from asyncflow.transfer_queue.client import encode_put, put_header, write_plan

    with client_for(address, config) as client:
        data = {"tokens": [torch.full((64,), 7)] * 32, "meta": [{"p": -1, "s": i, "crc": 0} for i in range(32)]}
        encoded, count = encode_put(data, None, None, None, None)
        reply = client._call(put_header("side", encoded, count, None, None, None, None, 60))
        plan = write_plan(reply["chunks"], encoded)
        first = next(iter(plan))
        client._write({first: plan[first][:1]}, reply["put"], time.monotonic() + 60)
        ready.put(("put", reply["put"]))
        time.sleep(3600)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def wait_for(predicate, timeout=300.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


# ----------------------------------------------------------------------------- phase 1: stream
def phase_stream(tq, args, workdir) -> dict:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "asyncflow.transfer_queue.client"])
    rows_per_producer = args.rows // args.producers // GROUP * GROUP
    total = rows_per_producer * args.producers
    client = tq.client()
    client.create_partition(STREAM, expected_rows=total)
    client.create_partition("side")
    ctrl_pid = tq.procs[0].pid
    rss_before = rss_mib(ctrl_pid)
    ready = ctx.Queue()
    procs, outputs = [], []
    for t, task in enumerate(TASKS):  # the consumers spread over the tasks, the first tasks take the rest
        per_task = max(1, args.consumers // len(TASKS) + (t < args.consumers % len(TASKS)))
        dp_size = per_task if TASKS[task][2] else 1
        for i in range(per_task):
            path = os.path.join(workdir, f"{task}-{i}.json")
            outputs.append((task, path))
            chaos = t == 1 and i == 0
            procs.append(ctx.Process(target=consumer, args=(tq.address, tq.config, task, i % dp_size,
                                                            dp_size, path, chaos)))
    victim = ctx.Process(target=victim_consumer, args=(tq.address, tq.config, ready))
    dying = ctx.Process(target=dying_producer, args=(tq.address, tq.config, ready))
    producers = [ctx.Process(target=producer, args=(tq.address, tq.config, p, rows_per_producer, p == 0))
                 for p in range(args.producers)]
    t0 = time.perf_counter()
    for p in procs + [victim, dying] + producers:
        p.start()
    signals = dict(ready.get(timeout=600) for _ in range(2))
    taken = signals["victim"]
    victim.kill()
    dying.kill()
    for p in producers:
        p.join(900)
    put_s = time.perf_counter() - t0
    for p in procs:
        p.join(900)
    wall = time.perf_counter() - t0
    for p in [victim, dying]:
        p.join(10)
    wait_for(lambda: client.status()["pending_puts"] == 0, what="the killed put to be rolled back")
    status = client.status()
    stream = status["partitions"][STREAM]
    received, dup, bad = {}, 0, 0
    for task, path in outputs:
        with open(path) as f:
            out = json.load(f)
        bad += out["bad"]
        got = received.setdefault(task, {})
        for key in map(tuple, out["keys"]):
            dup += key in got
            got[key] = True
    everything = {(p, s) for p in range(args.producers) for s in range(rows_per_producer)}
    lost = sum(len(everything - set(got)) for got in received.values())
    handed = sum(len(got) for got in received.values())
    rss_after = rss_mib(ctrl_pid)
    client.clear(STREAM, force=True)
    client.clear("side", force=True)
    rss_cleared = rss_mib(ctrl_pid)
    client.close()
    return {"producers": args.producers, "consumers": len(procs), "tasks": len(TASKS), "rows": total,
            "put_rows_per_s": total / put_s, "rows_per_s": handed / wall, "wall_s": wall,
            "lost": lost, "duplicated": dup, "corrupted": bad,
            "lease_expired": stream["tasks"]["seq"]["lease_expired"], "victim_took": taken,
            "side_live_rows": status["partitions"]["side"]["live_rows"],
            "side_rolled_back": status["partitions"]["side"]["rolled_back_rows"],
            "rss_before_mib": rss_before, "rss_after_mib": rss_after, "rss_cleared_mib": rss_cleared}


# ----------------------------------------------------------------------------- phase 2: storage unit
def phase_unit(tq) -> dict:
    import torch

    with tq.client() as client:
        client.create_partition("unit")
        toks = [row_payload(99, s) for s in range(512)]
        padded = torch.stack([torch.nn.functional.pad(t, (0, 4096 - len(t))) for t in toks])
        client.put("unit", {"x": padded[:256]})  # 4 MiB per put: split over both units
        client.put("unit", {"x": padded[256:]})
        meta = client.get_meta("unit", "look", ["x"], 512)
        client.release("unit", "look")
        on = dict(zip(meta.indexes, meta.locations["x"][1]))
        tq.kill_unit(1)
        wait_for(lambda: not client.status()["units"]["1"]["alive"], what="unit 1 declared dead")
        tq.restart_unit(1)
        wait_for(lambda: client.status()["units"]["1"]["alive"], what="unit 1 back")
        kept = [r for r, u in on.items() if u == 0]
        batch = client.get("unit", "read", ["x"], len(kept))
        bad = sum(not torch.equal(batch["x"][i], padded[r]) for i, r in enumerate(batch.indexes))
        reported = client.status("unit")["partitions"]["unit"]["lost_rows"]
        client.create_partition("after")
        client.put("after", {"x": padded})
        after = client.get("after", "read", ["x"], 512)
        bad_after = sum(not torch.equal(after["x"][i], padded[r]) for i, r in enumerate(after.indexes))
        on_new = set(after.meta.locations["x"][1])
        client.clear("unit", force=True)
        client.clear("after", force=True)
    return {"rows_on_dead_unit": sum(u == 1 for u in on.values()), "lost_reported": reported,
            "readable_after": len(batch), "corrupted": bad + bad_after, "units_after_restart": sorted(on_new)}


# ----------------------------------------------------------------------------- phase 3: latency
async def _park(address, config, count, ready_path):
    from asyncflow.transfer_queue import AsyncTransferQueueClient

    async with AsyncTransferQueueClient(address, config) as client:
        waits = [asyncio.ensure_future(client.get_meta("lat", f"parked{i % 8}", ["never"], 1, timeout=600))
                 for i in range(count)]
        open(ready_path, "w").close()
        await asyncio.gather(*waits, return_exceptions=True)


def parker(address, config, count, ready_path):
    asyncio.run(_park(address, config, count, ready_path))


def phase_latency(tq, sizes, parked_counts, reps, workdir) -> list[dict]:
    import torch

    out = []
    ctx = mp.get_context("forkserver")
    with tq.client() as client:
        for size in sizes:
            for parked in parked_counts:
                client.create_partition("lat")
                for start in range(0, size, 250_000):
                    n = min(250_000, size - start)
                    client.put("lat", {"id": torch.arange(start, start + n, dtype=torch.int32)})
                flag = os.path.join(workdir, f"parked-{size}-{parked}")
                proc = ctx.Process(target=parker, args=(tq.address, tq.config, parked, flag))
                proc.start()
                wait_for(lambda n=parked: client.status()["parked_gets"] == n, what="parked consumers")
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    client.get_meta("lat", "measure", ["id"], 64, block=False)
                    times.append((time.perf_counter() - t0) * 1e3)
                client.clear("lat", force=True)  # answers the parked gets (partition cleared)
                proc.join(60)
                times.sort()
                out.append({"rows": size, "parked": parked, "p50_ms": statistics.median(times),
                            "p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))]})
    return out


# ----------------------------------------------------------------------------- controller CPU per request
class _Frame:
    def __init__(self, data: bytes):
        self.bytes, self.buffer = data, memoryview(data)

    def __len__(self) -> int:
        return len(self.bytes)


def controller_cost(sizes, reps=200) -> dict:
    """Server-side CPU per request (decode, keyed MAC, handler, reply) of a controller that is not
    serving: requests go straight to its dispatch on this thread, so nothing else competes for its state."""
    from asyncflow.transfer_queue import TransferQueueConfig
    from asyncflow.transfer_queue.controller import Controller
    from asyncflow.transfer_queue.protocol import Signer, encode

    ctrl = Controller(TransferQueueConfig(secret="bench"))
    signer = Signer("bench")
    calls = iter(range(1, 1 << 30))

    def call(header: dict) -> None:
        ctrl.server._handle([_Frame(b"bench")] + [_Frame(bytes(f)) for f in
                                                  encode(signer, {**header, "id": next(calls)})])

    call({"op": "register_unit", "unit": 0, "address": "tcp://127.0.0.1:9", "arena": None, "size": 1 << 40})
    out = {}
    try:
        for size in sizes:
            call({"op": "create_partition", "partition": "c"})
            for start in range(0, size, 250_000):
                n = min(250_000, size - start)
                call({"op": "prepare_put", "partition": "c", "count": n,
                      "fields": {"id": [["dense", "int32", []], None, None]}})
                put = max(ctrl.puts)
                call({"op": "commit_put", "put": put})  # metadata only: no bytes are needed for get_meta
            for op, header in [("get_meta", {"op": "get_meta", "partition": "c", "task": "m", "fields": ["id"],
                                             "batch_size": 64}),
                               ("hello", {"op": "hello"}), ("status", {"op": "status", "partition": "c"})]:
                times = []
                for i in range(reps):
                    t0 = time.perf_counter()
                    call({**header, "rid": f"{size}.{op}.{i}"} if op == "get_meta" else header)
                    times.append((time.perf_counter() - t0) * 1e6)
                out[f"{op} {size:,} rows"] = statistics.median(times)
            call({"op": "clear", "partition": "c", "force": True})
    finally:
        ctrl.server.sock.close(linger=0)
        for cb in ctrl.server.on_close:
            cb()
        for sock in list(ctrl.server._extra):
            sock.close(linger=0)
        ctrl.server.ctx.term()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--consumers", type=int, default=32)
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--sizes", default="10000,1000000")
    parser.add_argument("--parked", default="1,64,256")
    parser.add_argument("--reps", type=int, default=1000)
    parser.add_argument("--smoke", action="store_true", help="2 producers, 5 consumers, 2k rows, small latency run")
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.smoke:
        args.producers, args.consumers, args.rows = 2, 5, 2048
        args.sizes, args.parked, args.reps = "10000", "1,64", 60
    import tempfile

    from asyncflow.transfer_queue import TransferQueueConfig, start

    config = TransferQueueConfig(deployment="processes", storage_unit_capacity_bytes=1 << 30, row_lease_s=5.0,
                                 put_lease_s=10.0, rpc_timeout_s=120.0,
                                 # generous: the development machine runs at load averages of 30-70
                                 heartbeat_timeout_s=args.heartbeat_timeout)
    results = {}
    with tempfile.TemporaryDirectory() as workdir, start(config) as tq:
        results["stream"] = phase_stream(tq, args, workdir)
        print("stream:", json.dumps(results["stream"]), flush=True)
        results["unit"] = phase_unit(tq)
        print("unit:", json.dumps(results["unit"]), flush=True)
        results["latency"] = phase_latency(tq, [int(s) for s in args.sizes.split(",")],
                                           [int(p) for p in args.parked.split(",")], args.reps, workdir)
    s, u = results["stream"], results["unit"]
    print(f"\nstream: {s['producers']} producers, {s['consumers']} consumer processes, {s['tasks']} tasks, "
          f"{s['rows']} rows; load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| metric | value |\n|---|---|")
    for label, value in [
            ("rows/s handed out through the controller (all tasks)", f"{s['rows_per_s']:,.0f}"),
            ("rows/s put (all producers)", f"{s['put_rows_per_s']:,.0f}"),
            ("rows lost / duplicated / corrupted (stream)", f"{s['lost']} / {s['duplicated']} / {s['corrupted']}"),
            ("rows of the killed consumer returned by lease", f"{s['lease_expired']} (it held {s['victim_took']})"),
            ("killed put: live rows left / rolled back", f"{s['side_live_rows']} / {s['side_rolled_back']}"),
            ("unit killed+restarted: rows on it / reported lost", f"{u['rows_on_dead_unit']} / {u['lost_reported']}"),
            ("unit killed+restarted: rows elsewhere read / corrupted", f"{u['readable_after']} / {u['corrupted']}"),
            ("controller RSS before / after / after clear, MiB",
             f"{s['rss_before_mib']:.0f} / {s['rss_after_mib']:.0f} / {s['rss_cleared_mib']:.0f}")]:
        print(f"| {label} | {value} |")
    print("\n| partition rows | parked consumers | get_meta p50 ms | get_meta p99 ms |\n|---|---|---|---|")
    for r in results["latency"]:
        print(f"| {r['rows']:,} | {r['parked']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} |")
    results["controller_us"] = controller_cost([int(x) for x in args.sizes.split(",")])
    print("\n| controller CPU per request (median) | us |\n|---|---|")
    for label, us in results["controller_us"].items():
        print(f"| {label} | {us:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    ok = s["lost"] == 0 and s["duplicated"] == 0 and s["corrupted"] == 0 and u["corrupted"] == 0 \
        and s["side_live_rows"] == 0 and u["lost_reported"] == u["rows_on_dead_unit"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    main()
