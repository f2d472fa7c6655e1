"""Test scaffolding for weight updates: real processes, real sockets, the real codec.

- ``StoreEngine``: a small in-test engine that keeps a copy of every tensor it loads.
- ``DescriptorEngine``: the same, but it reads buckets by shm name like an engine whose
  loader runs in another process (the descriptor path).
- ``LocalLink``: a WorkerLink calling a WeightReceiver in this process; every message is
  encoded and decoded with the wire codec on the way, so it must be msgpack-clean.
- ``Hub`` / ``ZmqLink``: a ROUTER in the sender process; ``worker_main`` runs a
  WeightReceiver behind a DEALER in a subprocess (``python weights_harness.py worker ...``).
- ``sender_main``: a sender in a subprocess, so tests can SIGKILL it or give it its own
  default process group.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time
from typing import Any

import torch
import zmq
import zmq.asyncio

from rollfleet.engines.base import Engine
from rollfleet.errors import RequestTimeout, from_code
from rollfleet.transport.codec import decode, encode
from rollfleet.transport.messages import Error, Register, Reply, Shutdown, Stats, WeightsBegin, WeightsBucket, WeightsEnd
from rollfleet.transport.sockets import make_socket
from rollfleet.weights import shm
from rollfleet.weights.bucket import Assembler
from rollfleet.weights.receiver import WeightReceiver

HERE = os.path.abspath(__file__)


def digest(t: torch.Tensor) -> list:
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(raw).hexdigest()]


def make_weights(big_bytes: int = 0, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and layouts; ``big_bytes`` adds one fp32 tensor of about that size."""
    g = torch.Generator().manual_seed(seed)
    out = [
        ("bf16", torch.randn(37, 53, generator=g).to(torch.bfloat16)),
        ("fp16", torch.randn(128, generator=g).to(torch.float16)),
        ("fp32_transposed", torch.randn(64, 33, generator=g).t()),
        ("fp64_sliced", torch.randn(50, generator=g, dtype=torch.float64)[::3]),
        ("int8", torch.randint(-128, 127, (77,), generator=g, dtype=torch.int8)),
        ("int32", torch.randint(-(2**31), 2**31 - 1, (9, 9), generator=g, dtype=torch.int32)),
        ("int64", torch.randint(-(2**62), 2**62, (33,), generator=g, dtype=torch.int64)),
        ("bool", torch.randint(0, 2, (21,), generator=g).bool()),
        ("uint8", torch.randint(0, 255, (5, 3), generator=g, dtype=torch.uint8)),
        ("empty", torch.empty(0, 7)),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("specials", torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45])),
    ]
    if hasattr(torch, "float8_e4m3fn"):
        out.append(("fp8", torch.randn(40, generator=g).to(torch.float8_e4m3fn)))
    out += [(f"small.{i}", torch.full((i + 1,), i, dtype=torch.int16)) for i in range(30)]
    if big_bytes:
        out.append(("big", torch.randn(big_bytes // 4 + 3, generator=g)))
    return out


class StoreEngine(Engine):
    """In-test engine: keeps a private copy of everything it loads."""

    name = "store"

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        self.weights: dict[str, torch.Tensor] = {}
        self.num_loads = 0
        self.delay_s = float(self.options.get("delay_s", 0.0))

    async def start(self) -> None:
        return None

    def generate(self, request_id, prompt_ids, params):  # pragma: no cover - not used here
        raise NotImplementedError

    async def abort(self, request_id: str) -> None:
        return None

    async def load_weights(self, weights) -> None:
        for name, tensor in weights:
            self.weights[name] = tensor.clone()  # the buffer is reused after this call
        self.num_loads += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)

    def digests(self) -> dict[str, list]:
        return {n: digest(t) for n, t in self.weights.items()}


class RemoteStoreEngine(StoreEngine):
    """StoreEngine that takes the sender's tensors in place over shm (RemoteTensor values),
    reading each into a tensor of its own, as a CPU engine's parameters would be."""

    name = "remote-store"
    accepts_remote_tensors = True

    async def load_weights(self, weights) -> None:
        from rollfleet.weights.remote import RemoteTensor

        self.remote_names = getattr(self, "remote_names", [])
        plain = []
        for name, tensor in weights:
            if isinstance(tensor, RemoteTensor):
                dst = torch.empty(tensor.shape, dtype=tensor.dtype)
                tensor.copy_into(dst)
                self.weights[name] = dst
                self.remote_names.append(name)
            else:
                plain.append((name, tensor))
        await super().load_weights(plain)


class DescriptorEngine(StoreEngine):
    """In-test engine that maps each bucket by its shm name, as a loader in another process would."""

    name = "descriptor"

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        self._assembler = Assembler()
        self.descriptors: list[dict] = []

    async def load_weights_from_descriptor(self, descriptor: dict) -> None:
        self.descriptors.append(descriptor)
        buf = shm.attach(descriptor["shm_name"], descriptor["size"])
        await self.load_weights(self._assembler.add(buf, descriptor["tensors"]))


def make_engine(kind: str, options: dict | None = None) -> StoreEngine:
    return DescriptorEngine(options) if kind == "descriptor" else StoreEngine(options)


class LocalLink:
    """A WorkerLink to a receiver in this process, through the wire codec."""

    def __init__(self, worker_id: str, receiver: WeightReceiver, host: str = "", device: str = "cpu") -> None:
        self.worker_id, self.receiver, self.host, self.device = worker_id, receiver, host, device
        self.sent: list[Any] = []

    async def call(self, msg, timeout: float | None = None) -> dict:
        msg = decode([encode(msg)])
        self.sent.append(msg)
        return await asyncio.wait_for(self.receiver.handle(msg), timeout)


class Hub:
    """The ROUTER side in the sender process; one ZmqLink per connected worker."""

    def __init__(self, addr: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER, addr, bind=True)
        self.addr = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.workers: dict[str, dict] = {}
        self._joined: dict[str, asyncio.Future] = {}
        self._pending: dict[tuple[str, str], asyncio.Future] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            ident, raw = await self.sock.recv_multipart()  # (identity, header)
            msg = decode([raw])
            wid = ident.decode()
            if isinstance(msg, Register):
                self.workers[wid] = {"host": msg.host, "device": msg.device, "pid": msg.pid}
                self._joined.setdefault(wid, asyncio.get_running_loop().create_future())
                if not self._joined[wid].done():
                    self._joined[wid].set_result(None)
                continue
            fut = self._pending.pop((wid, msg.id), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def link(self, worker_id: str, timeout: float = 60.0) -> "ZmqLink":
        fut = self._joined.setdefault(worker_id, asyncio.get_running_loop().create_future())
        await asyncio.wait_for(asyncio.shield(fut), timeout)
        info = self.workers[worker_id]
        return ZmqLink(self, worker_id, info["host"], info["device"])

    async def request(self, worker_id: str, msg, timeout: float | None) -> Any:
        fut = asyncio.get_running_loop().create_future()
        self._pending[(worker_id, msg.id)] = fut
        await self.sock.send_multipart([worker_id.encode(), encode(msg)])  # (identity, header)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"{worker_id}: no answer to {msg.id} in {timeout}s") from None
        finally:
            self._pending.pop((worker_id, msg.id), None)

    def close(self) -> None:
        self._reader.cancel()
        self.sock.close(linger=0)
        self.ctx.term()


class ZmqLink:
    def __init__(self, hub: Hub, worker_id: str, host: str, device: str) -> None:
        self.hub, self.worker_id, self.host, self.device = hub, worker_id, host, device

    async def call(self, msg, timeout: float | None = None) -> dict:
        answer = await self.hub.request(self.worker_id, msg, timeout)
        if isinstance(answer, Error):
            raise from_code(answer.code, answer.message)
        return answer.data


async def worker_main(addr: str, worker_id: str, engine_kind: str, delay_s: float, host: str, device: str) -> None:
    ctx = zmq.asyncio.Context()
    sock = make_socket(ctx, zmq.DEALER, addr, bind=False, identity=worker_id.encode())
    engine = make_engine(engine_kind, {"delay_s": delay_s})
    receiver = WeightReceiver(engine, device=device)
    parent = os.getppid()
    stop = asyncio.Event()
    tasks: set[asyncio.Task] = set()

    async def serve(msg) -> None:
        try:
            if isinstance(msg, (WeightsBegin, WeightsBucket, WeightsEnd)):
                answer = Reply(id=msg.id, data=await receiver.handle(msg))
            elif isinstance(msg, Stats):
                segments = receiver._segments  # cuda_ipc in place: the sender's memory mapped here
                answer = Reply(id=msg.id, data={"version": receiver.version, "digests": engine.digests(),
                                                "descriptors": len(getattr(engine, "descriptors", [])),
                                                "mapped_segments": len(segments) if segments is not None else 0})
            elif isinstance(msg, Shutdown):
                answer = Reply(id=msg.id)
                stop.set()
            else:
                answer = Error(id=msg.id, code="unknown_type", message=type(msg).__name__)
        except Exception as exc:
            answer = Error(id=msg.id, code=getattr(exc, "code", "internal"), message=str(exc))
        await sock.send_multipart([encode(answer)])  # (header,)

    await sock.send_multipart([encode(Register(id="reg", worker_id=worker_id, pid=os.getpid(), engine=engine_kind,
                                               host=host, device=device))])
    try:
        while not stop.is_set():
            if await sock.poll(200):
                (raw,) = await sock.recv_multipart()
                task = asyncio.create_task(serve(decode([raw])))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if os.getppid() != parent:
                break
        await asyncio.sleep(0.05)
    finally:
        receiver.close()
        sock.close(linger=0)
        ctx.term()


def _slow(weights, delay_s: float):
    for i, item in enumerate(weights):
        if i == 3:
            print("STARTED", flush=True)
        time.sleep(delay_s)
        yield item


def cuda_views(seed: int) -> list[tuple[str, torch.Tensor]]:
    """CUDA tensors of a MiB or more (read in place by cuda_ipc): views of one allocation at
    several offsets, and one of its own."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    whole = torch.randn(3 << 20, generator=g, device="cuda")  # 12 MiB
    return [
        ("cuda.head", whole[: 1 << 20].view(1024, 1024)),
        ("cuda.tail_bf16", whole[(3 << 20) - (1 << 19):].view(torch.bfloat16)),
        ("cuda.alone", torch.randn(512, 1024, generator=g, device="cuda", dtype=torch.float16)),
    ]


async def sender_main(args: argparse.Namespace) -> dict:
    from rollfleet.weights import WeightSender, WeightSyncConfig

    out: dict[str, Any] = {}
    if args.default_group:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{args.default_group}", rank=0, world_size=1)
    hub = Hub(args.addr)
    print("ADDR", hub.addr, flush=True)
    links = [await hub.link(w) for w in args.workers.split(",")]
    cfg = WeightSyncConfig(bucket_bytes=args.bucket, transport=args.transport, timeout_s=30,
                           in_place=args.in_place == "on")
    sender = WeightSender(cfg)
    out["reports"] = []
    weights: list = []
    for u in range(args.updates):
        previous, weights = weights, make_weights(big_bytes=args.big, seed=u)
        if args.cuda_source:
            # Tensors living on the trainer's GPU, allocated while the last update's still
            # live (so in other memory); those are then freed and the allocator's cache
            # emptied, while the worker may still map them.
            weights = [(n, t.cuda()) for n, t in weights] + cuda_views(u)
            del previous
            torch.cuda.empty_cache()
        report = await sender.update(_slow(weights, args.slow), args.version - args.updates + 1 + u, links)
        out["reports"].append(report.to_dict())
    out["report"] = out["reports"][-1]
    out["expected"] = {n: digest(t) for n, t in weights}
    out["received"] = {}
    for link in links:
        answer = await hub.request(link.worker_id, Stats(id="stats"), 30)
        out["received"][link.worker_id] = answer.data
    if args.default_group:
        import torch.distributed as dist

        x = torch.ones(4)
        dist.all_reduce(x)
        out["default_world"] = dist.get_world_size()
        out["default_allreduce"] = x.tolist()
        dist.destroy_process_group()
    for link in links:
        await hub.request(link.worker_id, Shutdown(id="bye"), 10)
    hub.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["worker", "sender"])
    p.add_argument("--addr", required=True)
    p.add_argument("--id", default="w0")
    p.add_argument("--engine", default="store")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--host", default="")
    p.add_argument("--device", default="cpu")
    p.add_argument("--workers", default="w0")
    p.add_argument("--transport", default="shm")
    p.add_argument("--bucket", type=int, default=4096)
    p.add_argument("--big", type=int, default=0)
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--version", type=int, default=1)
    p.add_argument("--default-group", default="")
    p.add_argument("--cuda-source", action="store_true")
    p.add_argument("--in-place", choices=["on", "off"], default="on")
    p.add_argument("--updates", type=int, default=1)
    args = p.parse_args()
    if args.role == "worker":
        asyncio.run(worker_main(args.addr, args.id, args.engine, args.delay, args.host, args.device))
    else:
        print("RESULT " + json.dumps(asyncio.run(sender_main(args))), flush=True)


if __name__ == "__main__":
    main()
