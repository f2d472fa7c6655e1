"""Weight-update throughput: rollfleet's transports against a plain copy of the same bytes.

End to end means: trainer tensors -> bucket buffer -> the engine's own parameters, timed
from the call to ``update`` until every worker has committed the version.

- ``shm`` and ``gloo``: a real fleet (``Supervisor``, one worker process running the torch
  engine on a Llama checkpoint of the requested size, written once into a temp dir) and
  ``await sup.update_weights(tensors, version, bucket_bytes=...)`` with tensors matching the
  engine's state dict. The supervisor's keep-last copy (``keep_last_weights``) is off for
  these rows: it is a separate cost (a fresh CPU copy of the whole model), measured in its
  own row ``shm_keep_last`` (the best of ``--reps`` updates at the bucket size where ``shm`` was
  fastest, with no warm-up of its own). Three shm rows: ``shm``, the default, where the engine
  reads the trainer's tensors of 1 MiB or more in place (process_vm_readv, one copy) once
  they are on huge pages (WeightSyncConfig.huge_pages: the sender moves them there after
  the second update that sends them); ``shm_as_allocated``, in place from a copy of the
  same tensors as torch allocated them (huge_pages off); ``shm_buffered`` (in_place off:
  trainer -> segment -> engine, two copies).
- ``cuda_ipc`` (with a GPU): the same sender and receiver without the engine: a worker process
  whose engine copies every tensor into preallocated CUDA tensors (``ParamEngine``), with
  ``--cuda-total-gb`` of weights (GPUs copy too fast for less to say much). Two rows: the
  default, where the engine reads the trainer's tensors in place (one copy), and
  ``cuda_ipc_buffered`` (``in_place=False``: trainer -> buffer -> engine, two copies).
- Baselines, measured in the same run, interleaved with the updates (best of each):
  ``memcpy``: one copy of the same bytes into preallocated CPU tensors (best of 1 thread and
  torch's default thread count); ``d2d``: one device-to-device copy into preallocated tensors.

Each update is run twice to warm up (the first one allocates the transfer buffers, which are
then kept; the second starts moving the trainer's tensors onto huge pages, which a trainer's
step between two updates leaves time for: the bench waits for it), then timed ``--reps``
times; the best is reported.

    python bench/bench_weights.py --quick --json bench/out/bench_weights.json
    python bench/bench_weights.py --total-gb 2 --buckets-mb 64,256,1024 --json bench/out/bench_weights.json

Keys: every ``..._gbps`` is 10^9 bytes per second, end to end, the best of a row's timed updates
(``--reps``, default 2; cuda_ipc rows: at least 20). Per bucket size, ``{mb}`` in MiB:
``shm_gbps_{mb}mb``, ``shm_buffered_gbps_{mb}mb`` (every bucket size),
``shm_as_allocated_gbps_{mb}mb`` (the largest size only), ``gloo_gbps_{mb}mb`` (every size;
``--quick``: the smallest only), ``shm_keep_last_gbps_{mb}mb`` (only at the size where ``shm`` was
fastest), and with a GPU ``cuda_ipc_gbps_{mb}mb``, ``cuda_ipc_buffered_gbps_{mb}mb``. The best over
bucket sizes of each row: ``shm_gbps``, ``shm_as_allocated_gbps``, ``shm_buffered_gbps``,
``shm_keep_last_gbps``, ``gloo_gbps``, ``cuda_ipc_gbps``, ``cuda_ipc_buffered_gbps``. Baselines:
``memcpy_gbps`` (the best of every CPU copy timed in the run: one before each timed fleet update,
and a last set after the fleet rows), ``d2d_gbps`` (GPU only: the best of three sets, before,
between and after the two cuda_ipc rows). Ratios: ``shm_vs_memcpy``, ``shm_as_allocated_vs_memcpy``,
``shm_buffered_vs_memcpy`` (the row's best / ``memcpy_gbps``), ``cuda_ipc_vs_d2d``,
``cuda_ipc_buffered_vs_d2d`` (the row's best / ``d2d_gbps``). ``cuda_ipc_measured`` (always
written: whether the cuda_ipc rows, ``d2d_gbps`` and their ratios are in this JSON; false without
a CUDA device, or without cuda_ipc in ``--transports``; the table then says which, and
``cuda_ipc_not_measured_reason``, written only then, too). The run: ``bytes`` (bytes of one CPU
update: the Llama checkpoint's tensors, or made-up ones when no fleet row ran), ``num_tensors``
(tensors in it), ``bytes_cuda`` (bytes of one cuda_ipc update, GPU only), ``buckets_mb`` (the bucket
sizes, a comma-separated string), ``reps`` (timed updates per CPU row and bucket size),
``cuda_reps`` (the same for the cuda_ipc rows and the d2d baseline, GPU only), ``quick``; and the
machine facts ``machine_*`` of bench/common.py (``MACHINE_KEYS``).

The checkpoint has as many whole layers as come closest to the size asked for, so an update moves
about that much, not exactly: the default 1 GiB gives 8 layers, 1,084,297,216 bytes (about
1.01 GiB); ``--quick`` asks for 400 MiB and gets 2 layers, 467,685,376 bytes (about 450 MiB).

``--quick`` changes the defaults only (about 450 MiB of weights, buckets of 64 and 256 MiB, gloo
at the smallest bucket size only): ``--total-gb`` and ``--buckets-mb`` given with it stand. ``--reps``
is 2 unless given, with or without ``--quick``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (bench_parser, copy_gbps, memcpy_gbps, machine_info, png_path, print_table,  # noqa: E402
                    run_loop, run_main, child_env, stop_signals, write_json)

if __name__ == "__main__":
    stop_signals()  # first: a signal while the imports below run (seconds) stops cleanly too

import torch  # noqa: E402
import zmq  # noqa: E402

from rollfleet.engines.base import Engine  # noqa: E402
from rollfleet.errors import RequestTimeout, from_code  # noqa: E402
from rollfleet.transport.aio import LoopSocket  # noqa: E402
from rollfleet.transport.codec import decode, encode, unbatch  # noqa: E402
from rollfleet.transport.messages import Batch, Error, Register, Shutdown  # noqa: E402
from rollfleet.transport.sockets import make_socket  # noqa: E402
from rollfleet.weights import WeightSender, WeightSyncConfig, release_buffers, remote  # noqa: E402

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


def worker(addr: str, worker_id: str, device: str) -> None:
    """rollfleet's own engine worker process (its sockets, receiver and message handling),
    serving ParamEngine."""
    from rollfleet.actors import worker as engine_worker

    engine_worker.create_engine = lambda name, options=None: ParamEngine(device)
    ew = engine_worker.EngineWorker({"worker_id": worker_id, "addr": addr, "engine": "params", "device": device})
    run_loop(ew.run())


class Link:
    """A minimal WorkerLink over a ROUTER socket read by rollfleet's LoopSocket (the
    supervisor's role in this bench; registration and heartbeats are ignored)."""

    def __init__(self, device: str) -> None:
        self.sock: LoopSocket | None = None  # sends through it: a bare send could eat the reader's wake-up
        self.device, self.host = device, ""
        self.worker_id = ""
        self.registered = asyncio.get_running_loop().create_future()
        self.waiting: dict[str, asyncio.Future] = {}

    def on_frames(self, frames) -> None:  # (identity, header)
        msg = decode(frames[1:])
        for one in unbatch(msg) if isinstance(msg, Batch) else [msg]:
            if isinstance(one, Register) and not self.registered.done():
                self.worker_id = one.worker_id
                self.registered.set_result(one)
            fut = self.waiting.pop(getattr(one, "id", ""), None)
            if fut is not None and not fut.done():
                fut.set_result(one)

    async def call(self, msg, timeout=None) -> dict:
        fut = self.waiting[msg.id] = asyncio.get_running_loop().create_future()
        self.sock.send([self.worker_id.encode(), encode(msg)])  # (identity, header)
        try:
            answer = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no answer to {msg.id}") from None
        if isinstance(answer, Error):
            raise from_code(answer.code, answer.message)
        return answer.data


async def measure(transport: str, device: str, weights, buckets: list[int], reps: int,
                  in_place: bool = True) -> dict[int, float]:
    """GB/s of an end-to-end update per bucket size, through one worker process."""
    tmp = tempfile.mkdtemp(prefix="rf-bench-")
    addr = f"ipc://{tmp}/hub.sock"
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER, addr, bind=True)
    link = Link(device)
    reader = link.sock = LoopSocket(sock, link.on_frames)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", addr, "--device", device],
                            env=child_env())
    try:
        await asyncio.wait_for(link.registered, 120)
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        out = {}
        for bucket in buckets:
            cfg = WeightSyncConfig(bucket_bytes=bucket, transport=transport, timeout_s=60,
                                   master_addr="127.0.0.1", in_place=in_place)
            sender = WeightSender(cfg)
            await sender.update(iter(weights), 0, [link])  # warm-up: engine allocates its tensors
            best = 0.0
            for rep in range(reps):
                t0 = time.perf_counter()
                await sender.update(iter(weights), rep + 1, [link])
                best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
            out[bucket] = best
        reader.send([link.worker_id.encode(), encode(Shutdown(id="bye"))])  # (identity, header)
        await asyncio.to_thread(proc.wait, 60)
        release_buffers()  # the worker has dropped its mappings: free ours before the next transport
        return out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.close()
        sock.close(linger=0)
        ctx.term()
        shutil.rmtree(tmp, ignore_errors=True)  # the socket file's folder


def make_weights(total: int, device: str) -> list:
    """bf16 tensors of 64 MiB (smaller for small totals), filled with arbitrary values."""
    size = min(64 * MB, max(MB, total // 8))
    n = max(1, total // size)
    return [(f"layer.{i}.weight", torch.full((size // 2,), i * 0.5, dtype=torch.bfloat16, device=device))
            for i in range(n)]


# ---------------------------------------------------------------------------- real fleet


def llama_checkpoint(folder: str, total: int) -> list[tuple[str, torch.Tensor]]:
    """Write a bf16 Llama checkpoint of about ``total`` bytes (hidden 2048, vocab 32000, as
    many layers as fit, at least 1) into ``folder``; return trainer-side tensors of the same
    names, shapes and dtype (other values, so an update really changes the engine)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    per_layer = (4 * 2048 * 2048 + 3 * 2048 * 5632 + 2 * 2048) * 2
    fixed = (2 * 32000 * 2048 + 2048) * 2
    layers = max(1, round((total - fixed) / per_layer))
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512,
                         tie_word_embeddings=False, dtype=torch.bfloat16)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    saved = {k: torch.full(s, 0.01, dtype=torch.bfloat16) for k, s in shapes.items()}
    save_file(saved, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    del saved
    return [(k, torch.empty(s, dtype=torch.bfloat16).uniform_(-0.02, 0.02)) for k, s in shapes.items()]


async def fleet_curves(folder: str, weights, buckets: list[int], gloo_buckets: list[int], reps: int,
                       baseline: list[float]) -> dict[str, dict[int, float]]:
    """GB/s of sup.update_weights into a live torch engine, per transport and bucket size.
    Appends a memcpy measurement before each timed update to ``baseline``."""
    from rollfleet.actors.config import FleetConfig
    from rollfleet.actors.supervisor import Supervisor

    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    config = FleetConfig(engine="torch", num_workers=1, keep_last_weights=False, frontend_addr=None,
                         engine_options={"model": folder, "dtype": "bfloat16"}, call_timeout_s=300)
    curves: dict[str, dict[int, float]] = {"shm": {}, "shm_as_allocated": {}, "shm_buffered": {}, "gloo": {}}
    fresh = [(name, t.clone()) for name, t in weights]  # never sent before the shm_as_allocated row
    version = 0
    async with Supervisor(config) as sup:
        async def timed(transport: str, bucket: int, tensors=weights) -> float:
            nonlocal version
            version += 1
            t0 = time.perf_counter()
            await sup.update_weights(iter(tensors), version, transport=transport, bucket_bytes=bucket)
            return nbytes / (time.perf_counter() - t0) / 1e9

        rows = [("shm", "shm", buckets, {}),
                ("shm_as_allocated", "shm", buckets[-1:], {"huge_pages": False}),
                ("shm_buffered", "shm", buckets, {"in_place": False}),
                ("gloo", "collective", gloo_buckets, {})]
        for row, transport, sizes, options in rows:
            sup.config.weights.update(options)
            tensors = fresh if row == "shm_as_allocated" else weights
            for bucket in sizes:
                for _ in range(2):  # warm-up: buffers allocated and mapped, tensors onto huge pages
                    await timed(transport, bucket, tensors)
                await asyncio.to_thread(remote.settle_huge_pages)
                best = 0.0
                for _ in range(reps):
                    baseline.append(memcpy_gbps(weights, 1))
                    best = max(best, await timed(transport, bucket, tensors))
                curves[row][bucket] = best
            for key in options:
                sup.config.weights.pop(key)
        # The supervisor's own copy of each update, kept for restarted workers (on by default).
        if curves["shm"]:  # (not when only gloo was asked for)
            best_bucket = max(curves["shm"], key=curves["shm"].get)
            sup.weights.keep_last_weights = True
            curves["shm_keep_last"] = {best_bucket: max([await timed("shm", best_bucket) for _ in range(reps)])}
    return curves


TRANSPORTS = ("shm", "gloo", "cuda_ipc")


def _sizes(text: str) -> str:
    """An argparse type: comma-separated positive ints (MiB)."""
    try:
        if all(int(b) > 0 for b in text.split(",")):
            return text
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected comma-separated sizes in MiB (e.g. 64,256), got {text!r}")


def _positive(kind):  # type: ignore[no-untyped-def]
    """An argparse type: a number of ``kind`` (int or float) greater than 0."""

    def parse(text: str):  # type: ignore[no-untyped-def]
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value

    return parse


def _transports(text: str) -> str:
    """An argparse type: comma-separated names out of TRANSPORTS."""
    names = text.split(",")
    if not any(name.strip() for name in names):
        raise argparse.ArgumentTypeError(f"is empty: name one or more of {', '.join(TRANSPORTS)}")
    if not all(names):
        raise argparse.ArgumentTypeError(f"an empty name in {text!r}: the transports are {', '.join(TRANSPORTS)}")
    unknown = sorted(set(names) - set(TRANSPORTS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown transport(s) {', '.join(unknown)}; the transports are "
                                         f"{', '.join(TRANSPORTS)}")
    return text


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--total-gb", type=_positive(float), default=None,
                   help="GiB of weights per CPU update, > 0, 1 to 4 suggested (the upper end not checked); the "
                        "checkpoint holds whole layers, so the bytes moved differ a little (default 1: about "
                        "1.01 GiB; with --quick 400 MiB asked for, about 450 MiB moved)")
    p.add_argument("--buckets-mb", default=None, type=_sizes,
                   help="comma-separated bucket sizes in MiB, run smallest first (default 64,128,256,512,1024; "
                        "with --quick 64,256)")
    p.add_argument("--reps", type=_positive(int), default=None,
                   help="timed updates per row and bucket size, the best counts (default 2; cuda_ipc rows: at least 20)")
    p.add_argument("--cuda-total-gb", type=_positive(float), default=4.0,
                   help="GiB of weights per cuda_ipc update (default 4, with --quick too; on the GPU, twice: "
                        "sender and engine)")
    p.add_argument("--transports", default="shm,gloo,cuda_ipc", type=_transports,
                   help="comma-separated (default shm,gloo,cuda_ipc); cuda_ipc runs only with a GPU; "
                        "shm/gloo need transformers")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, "w0", args.device)
        return
    # --quick changes the defaults only: what is given on the command line stands.
    total = int(args.total_gb * (1 << 30)) if args.total_gb is not None else (400 * MB if args.quick else 1 << 30)
    buckets_mb = args.buckets_mb or ("64,256" if args.quick else "64,128,256,512,1024")
    buckets = sorted({int(b) * MB for b in buckets_mb.split(",")})  # "the largest", "the first" below: by size
    reps = args.reps if args.reps is not None else 2
    wanted = set(args.transports.split(","))
    result: dict = {"quick": bool(args.quick), **machine_info()}
    curves: dict[str, dict[int, float]] = {}
    baseline: list[float] = []
    weights = None
    if wanted & {"shm", "gloo"}:
        with tempfile.TemporaryDirectory(prefix="rf-bench-model-") as folder:
            weights = llama_checkpoint(folder, total)
            gloo_buckets = (buckets[:1] if args.quick else buckets) if "gloo" in wanted else []
            fleet = run_loop(fleet_curves(folder, weights, buckets if "shm" in wanted else [], gloo_buckets,
                                          reps, baseline), use_uvloop=False)
            curves.update({k: v for k, v in fleet.items() if v})
    if weights is None:
        weights = make_weights(total, "cpu")
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    baseline.append(memcpy_gbps(weights, reps))
    result.update(bytes=nbytes, num_tensors=len(weights), buckets_mb=",".join(str(b // MB) for b in buckets),
                  reps=reps)
    result["memcpy_gbps"] = max(baseline)
    cuda_skipped = ("not in --transports" if "cuda_ipc" not in wanted
                    else None if torch.cuda.is_available() else "no CUDA device here")
    result["cuda_ipc_measured"] = cuda_skipped is None
    if cuda_skipped:
        result["cuda_ipc_not_measured_reason"] = cuda_skipped
    if cuda_skipped == "no CUDA device here":
        print("cuda_ipc: no CUDA device here, not measured", flush=True)
    if cuda_skipped is None:
        gpu_weights = make_weights(int(args.cuda_total_gb * (1 << 30)), "cuda")
        gpu_reps = max(reps, 20)  # an update takes milliseconds here: best of many
        result["bytes_cuda"] = sum(t.numel() * t.element_size() for _, t in gpu_weights)
        result["cuda_reps"] = gpu_reps
        result["d2d_gbps"] = copy_gbps(gpu_weights, "cuda", gpu_reps)
        curves["cuda_ipc"] = run_loop(measure("cuda_ipc", "cuda:0", gpu_weights, buckets, gpu_reps),
                                     use_uvloop=False)
        result["d2d_gbps"] = max(result["d2d_gbps"], copy_gbps(gpu_weights, "cuda", gpu_reps))
        curves["cuda_ipc_buffered"] = run_loop(measure("cuda_ipc", "cuda:0", gpu_weights, buckets, gpu_reps,
                                                       in_place=False), use_uvloop=False)
        result["d2d_gbps"] = max(result["d2d_gbps"], copy_gbps(gpu_weights, "cuda", gpu_reps))
    for name, curve in curves.items():
        for bucket, gbps in curve.items():
            result[f"{name}_gbps_{bucket // MB}mb"] = gbps
        result[f"{name}_gbps"] = max(curve.values())
    if "shm_gbps" in result:
        result["shm_vs_memcpy"] = result["shm_gbps"] / result["memcpy_gbps"]
        for row in ("shm_as_allocated", "shm_buffered"):
            if f"{row}_gbps" in result:
                result[f"{row}_vs_memcpy"] = result[f"{row}_gbps"] / result["memcpy_gbps"]
    if "cuda_ipc_gbps" in result:
        result["cuda_ipc_vs_d2d"] = result["cuda_ipc_gbps"] / result["d2d_gbps"]
        result["cuda_ipc_buffered_vs_d2d"] = result["cuda_ipc_buffered_gbps"] / result["d2d_gbps"]

    print(f"weights: {nbytes / 1e9:.2f} GB in {len(weights)} tensors; GB/s end to end, best of {reps}"
          + (f" (cuda_ipc rows: best of {result['cuda_reps']})" if "cuda_reps" in result else ""))
    rows = [[name] + [curve.get(b) for b in buckets] for name, curve in curves.items()]
    if cuda_skipped:
        rows.append([f"cuda_ipc: not measured ({cuda_skipped})"] + [None] * len(buckets))
    print_table(["transport"] + [f"{b // MB} MiB" for b in buckets], rows)
    print(f"memcpy {result['memcpy_gbps']:.2f} GB/s", end="")
    if "shm_vs_memcpy" in result:
        print(f"   shm/memcpy {result['shm_vs_memcpy']:.2f} (goal >= 0.5)", end="")
    print()
    if "d2d_gbps" in result:
        print(f"d2d    {result['d2d_gbps']:.2f} GB/s ({result['bytes_cuda'] / 1e9:.2f} GB)   "
              f"cuda_ipc/d2d {result['cuda_ipc_vs_d2d']:.2f} (goal >= 0.7), "
              f"buffered {result['cuda_ipc_buffered_vs_d2d']:.2f}")
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    path = png_path(args)
    if path and plot(path, curves, result, nbytes):
        print(f"wrote {path}")


def plot(path: str, curves: dict, result: dict, nbytes: int) -> bool:
    """Draw the curves into ``path``; False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot at {path}")
        return False
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
    ax.set_yscale("log")
    ax.set_xlabel("bucket size (MiB)")
    ax.set_ylabel("GB/s (end to end)")
    ax.set_title(f"weight update, {nbytes / 1e9:.2f} GB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(run_main(main))
