"""Weight-update throughput: rollfleet's transports against a plain copy of the same bytes.

For each bucket size, one engine worker process (a receiver over ZeroMQ, like the real
worker) holds preallocated torch tensors and copies every received tensor into them, so the
timing is end-to-end: trainer tensors -> bucket buffer -> engine tensors. Baselines, in the
same run: ``memcpy`` (one CPU copy of the same bytes) and, with a GPU, ``d2d`` (one
device-to-device copy). Each update is run once to warm up (allocation), then timed.

    python bench/bench_weights.py --quick --json out.json
    python bench/bench_weights.py --total-gb 2 --buckets-mb 64,256,1024 --png curve.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import zmq
import zmq.asyncio

from rollfleet.engines.base import Engine
from rollfleet.errors import RequestTimeout, from_code
from rollfleet.transport.codec import decode, encode
from rollfleet.transport.messages import Error, Register, Reply, Shutdown, WeightsBegin, WeightsBucket, WeightsEnd
from rollfleet.transport.sockets import make_socket
from rollfleet.weights import WeightReceiver, WeightSender, WeightSyncConfig

MB = 1 << 20


class ParamEngine(Engine):
    """Engine stand-in whose load_weights copies into live torch tensors, as a torch model's
    parameters would be (allocated on first sight, reused afterwards)."""

    name = "params"

    def __init__(self, device: str) -> None:
        super().__init__({})
        self.device = device
        self.params: dict[str, torch.Tensor] = {}

    async def start(self) -> None:
        return None

    def generate(self, request_id, prompt_ids, params):  # pragma: no cover
        raise NotImplementedError

    async def abort(self, request_id: str) -> None:
        return None

    async def load_weights(self, weights) -> None:
        with torch.no_grad():
            for name, t in weights:
                dst = self.params.get(name)
                if dst is None:
                    dst = self.params[name] = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                dst.copy_(t)


async def worker(addr: str, worker_id: str, device: str) -> None:
    ctx = zmq.asyncio.Context()
    sock = make_socket(ctx, zmq.DEALER, addr, bind=False, identity=worker_id.encode())
    receiver = WeightReceiver(ParamEngine(device), device=device)
    await sock.send_multipart([encode(Register(id="r", worker_id=worker_id, pid=os.getpid(), engine="params",
                                               device=device))])  # (header,)
    while True:
        (raw,) = await sock.recv_multipart()
        msg = decode([raw])
        if isinstance(msg, Shutdown):
            break
        try:
            answer = Reply(id=msg.id, data=await receiver.handle(msg))
        except Exception as exc:
            answer = Error(id=msg.id, code=getattr(exc, "code", "internal"), message=str(exc))
        await sock.send_multipart([encode(answer)])  # (header,)
    receiver.close()
    sock.close(linger=0)
    ctx.term()


class Link:
    """A minimal WorkerLink over a ROUTER socket (the supervisor's role in this bench)."""

    def __init__(self, sock, worker_id: str, device: str) -> None:
        self.sock, self.worker_id, self.device, self.host = sock, worker_id, device, ""
        self.waiting: dict[str, asyncio.Future] = {}

    async def call(self, msg, timeout=None) -> dict:
        fut = self.waiting[msg.id] = asyncio.get_running_loop().create_future()
        await self.sock.send_multipart([self.worker_id.encode(), encode(msg)])  # (identity, header)
        try:
            answer = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no answer to {msg.id}") from None
        if isinstance(answer, Error):
            raise from_code(answer.code, answer.message)
        return answer.data


async def measure(transport: str, device: str, weights, buckets: list[int], reps: int) -> dict[int, float]:
    """GB/s of an end-to-end update per bucket size, through one worker process."""
    tmp = tempfile.mkdtemp(prefix="rf-bench-")
    addr = f"ipc://{tmp}/hub.sock"
    ctx = zmq.asyncio.Context()
    sock = make_socket(ctx, zmq.ROUTER, addr, bind=True)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", addr, "--device", device])
    try:
        ident, raw = await asyncio.wait_for(sock.recv_multipart(), 120)
        link = Link(sock, ident.decode(), device)

        async def read() -> None:
            while True:
                _, raw = await sock.recv_multipart()
                msg = decode([raw])
                fut = link.waiting.pop(msg.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

        reader = asyncio.create_task(read())
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        out = {}
        for bucket in buckets:
            cfg = WeightSyncConfig(bucket_bytes=bucket, transport=transport, timeout_s=300,
                                   master_addr="127.0.0.1")
            sender = WeightSender(cfg)
            await sender.update(iter(weights), 0, [link])  # warm-up: engine allocates its tensors
            best = 0.0
            for rep in range(reps):
                t0 = time.perf_counter()
                await sender.update(iter(weights), rep + 1, [link])
                best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
            out[bucket] = best
        await sock.send_multipart([link.worker_id.encode(), encode(Shutdown(id="bye"))])  # (identity, header)
        reader.cancel()
        proc.wait(60)
        return out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close(linger=0)
        ctx.term()


def copy_gbps(weights, device: str, reps: int) -> float:
    """One copy of the same bytes into preallocated tensors on ``device``."""
    dst = [torch.empty_like(t, device=device) for _, t in weights]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    best = 0.0
    for _ in range(reps + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d, (_, t) in zip(dst, weights):
            d.copy_(t)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def make_weights(total: int, device: str) -> list:
    """bf16 tensors of 64 MB (smaller for small totals), filled with arbitrary values."""
    size = min(64 * MB, max(MB, total // 8))
    n = max(1, total // size)
    return [(f"layer.{i}.weight", torch.full((size // 2,), i * 0.5, dtype=torch.bfloat16, device=device))
            for i in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes; under a minute on 2 cores")
    p.add_argument("--json", help="write the flat JSON result here")
    p.add_argument("--png", help="write the GB/s-against-bucket-size plot here")
    p.add_argument("--total-gb", type=float, default=1.0, help="bytes of weights per update (1-4)")
    p.add_argument("--buckets-mb", default="64,128,256,512,1024")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--no-gloo", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        asyncio.run(worker(args.worker, "w0", args.device))
        return
    total = int(args.total_gb * (1 << 30))
    buckets = [int(b) * MB for b in args.buckets_mb.split(",")]
    reps = args.reps
    if args.quick:
        total, buckets, reps = 256 * MB, [16 * MB, 64 * MB], 1
    weights = make_weights(total, "cpu")
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    result: dict = {"bytes": nbytes, "buckets_mb": [b // MB for b in buckets]}
    result["memcpy_gbps"] = copy_gbps(weights, "cpu", reps)
    curves = {"shm": asyncio.run(measure("shm", "cpu", weights, buckets, reps))}
    if not args.no_gloo:
        curves["gloo"] = asyncio.run(measure("collective", "cpu", weights, buckets[:1] if args.quick else buckets, reps))
    if torch.cuda.is_available():
        gpu_weights = [(n, t.cuda()) for n, t in weights]
        result["d2d_gbps"] = copy_gbps(gpu_weights, "cuda", reps)
        curves["cuda_ipc"] = asyncio.run(measure("cuda_ipc", "cuda:0", gpu_weights, buckets, reps))
    for name, curve in curves.items():
        for bucket, gbps in curve.items():
            result[f"{name}_gbps_{bucket // MB}mb"] = gbps
        result[f"{name}_gbps"] = max(curve.values())
    result["shm_vs_memcpy"] = result["shm_gbps"] / result["memcpy_gbps"]
    if "cuda_ipc_gbps" in result:
        result["cuda_ipc_vs_d2d"] = result["cuda_ipc_gbps"] / result["d2d_gbps"]

    print(f"weights: {nbytes / 1e9:.2f} GB in {len(weights)} tensors")
    print(f"{'transport':<10}" + "".join(f"{b // MB:>10} MB" for b in buckets))
    for name, curve in curves.items():
        print(f"{name:<10}" + "".join(f"{curve[b]:>10.2f} GB/s"[:-5] + "    " if b in curve else f"{'-':>13}"
                                      for b in buckets))
    print(f"memcpy     {result['memcpy_gbps']:.2f} GB/s   shm/memcpy {result['shm_vs_memcpy']:.2f} (goal >= 0.5)")
    if "d2d_gbps" in result:
        print(f"d2d        {result['d2d_gbps']:.2f} GB/s   cuda_ipc/d2d {result['cuda_ipc_vs_d2d']:.2f} (goal >= 0.7)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, curve in curves.items():
            xs = sorted(curve)
            ax.plot([x // MB for x in xs], [curve[x] for x in xs], marker="o", label=name)
        ax.axhline(result["memcpy_gbps"], linestyle="--", color="grey", label="memcpy")
        if "d2d_gbps" in result:
            ax.axhline(result["d2d_gbps"], linestyle=":", color="black", label="d2d copy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bucket size (MB)")
        ax.set_ylabel("GB/s (end-to-end)")
        ax.set_title(f"weight update, {nbytes / 1e9:.2f} GB")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
