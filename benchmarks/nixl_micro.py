"""Raw NIXL bandwidth for the KV block shapes a model uses, to set serving's KV rate against.

Two NIXL agents in this process, each with a pool, READ from each other over UCX. On a CPU
host both pools are host memory (DRAM<-DRAM, as a decode engine pulls a prefill engine's
blocks there); on a GPU node `--paths` names GPU pools too: `VRAM0:VRAM1` is a decode GPU
pulling from a prefill GPU on the same node (NVLink or PCIe), `VRAM0:DRAM` a GPU loading
blocks from host memory (the CPU tier's direction), `DRAM:VRAM0` the reverse (a save). A
transfer of `n` KV blocks is cut the way vLLM's NixlConnector cuts it: one descriptor per
layer, per K and V, per block. What serving achieves (bytes / transfer seconds from /metrics)
divided by this figure is the transfer efficiency of the whole path: handshakes,
notifications, scheduling.

The agents run without a progress thread (as Tandem's KV store does): the nixl Python API
hard-codes `pthrDelay = 0`, so a progress thread would spin a core that the measurement needs.
The timing loop polls both agents instead (the target's UCX worker must progress for wire-up).

    python -m benchmarks.nixl_micro --model ~/.cache/tandem/tiny-llama-v2 --block-size 128
    python benchmarks/nixl_micro.py --model llama-3-8b/ --block-size 16 --prompt-tokens 2048 \
        --paths VRAM0:VRAM0,VRAM0:DRAM,DRAM:VRAM0 --json nixl-gpu.json

(The second form runs the file alone, so a GPU node needs only nixl, msgspec, numpy and a CUDA
build of torch, not the rest of Tandem's bench.) `--processes 2` puts the target agent in a
process of its own, as a prefill engine is to the decode engine pulling from it: transports
such as CUDA IPC and CMA only work between processes. A run with a GPU pool sets UCX's
variables as disaggregated GPU engines get them (`actors.nixl_agent.GPU_UCX_ENV`), unless
the environment already names them, and gives each agent the UCX worker threads a GPU engine's
agent has (`--num-threads` to choose).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from actors.nixl_agent import GPU_UCX_ENV, make_nixl_agent
from connectors.config import GPU_NUM_THREADS, NixlConfig

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


class KVGeometry(msgspec.Struct, frozen=True):
    """The shape of one KV cache block, from the model's config and the engine's block size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int  # tokens per block

    @property
    def chunk_bytes(self) -> int:
        """One layer's K (or V) of one block: what one NIXL descriptor covers."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        """K and V of every layer for one block."""
        return 2 * self.num_layers * self.chunk_bytes

    def num_blocks(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @classmethod
    def from_model(cls, model_dir: str | Path, block_size: int) -> KVGeometry:
        """Read a Hugging Face config.json (head_dim defaults to hidden_size / heads)."""
        cfg = json.loads((Path(model_dir).expanduser() / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        heads = cfg["num_attention_heads"]
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        return cls(
            num_layers=cfg["num_hidden_layers"],
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            dtype_bytes=_DTYPE_BYTES.get(str(dtype), 2),
            block_size=block_size,
        )


class Memory(msgspec.Struct, frozen=True):
    """Where a pool lives: host memory, or GPU `device`'s memory."""

    kind: Literal["DRAM", "VRAM"] = "DRAM"
    device: int = 0

    @classmethod
    def parse(cls, text: str) -> Memory:
        """`DRAM`, `VRAM` (GPU 0) or `VRAM<n>`."""
        if text == "DRAM":
            return cls()
        if text.startswith("VRAM") and (text[4:] == "" or text[4:].isdigit()):
            return cls("VRAM", int(text[4:] or 0))
        raise ValueError(f"memory {text!r}: write DRAM, VRAM or VRAM<gpu index>, e.g. VRAM1")

    def __str__(self) -> str:
        return "DRAM" if self.kind == "DRAM" else f"VRAM{self.device}"


def parse_paths(text: str) -> list[tuple[Memory, Memory]]:
    """`reader:target[,reader:target...]`, e.g. `VRAM0:VRAM1,VRAM0:DRAM`."""
    paths = []
    for pair in text.split(","):
        reader, sep, target = pair.strip().partition(":")
        if not sep:
            raise ValueError(f"path {pair!r}: write reader:target, e.g. VRAM0:DRAM (the reader pulls from the target)")
        paths.append((Memory.parse(reader), Memory.parse(target)))
    return paths


class MicroResult(msgspec.Struct, frozen=True):
    """One transfer size, timed over many iterations."""

    label: str
    num_blocks: int
    num_bytes: int
    num_descs: int
    iterations: int
    median_s: float
    p90_s: float
    path: str = "DRAM <- DRAM"  # reader's memory <- target's memory

    @property
    def gib_per_s(self) -> float:
        return self.num_bytes / self.median_s / 2**30 if self.median_s > 0 else 0.0


class _Agent:
    """A NIXL agent owning one registered pool, in host memory or on a GPU."""

    def __init__(self, pool_bytes: int, memory: Memory, threads: int = 0) -> None:
        self.memory = memory
        self.pool: Any
        if memory.kind == "DRAM":
            self.pool = np.ones(pool_bytes, dtype=np.uint8)  # touched, so pages are committed
            self.base = self.pool.ctypes.data
        else:
            self.pool = _gpu_pool(pool_bytes, memory.device)
            self.base = self.pool.data_ptr()
        # Tandem's one agent builder, as engines make theirs (no progress thread; `threads` UCX
        # worker threads): what is measured is the agent serving uses.
        self.agent = make_nixl_agent(f"tandem-micro-{uuid.uuid4().hex[:8]}", progress_thread=False, num_threads=threads)
        self.reg = self.agent.register_memory([(self.base, pool_bytes, memory.device, "")], memory.kind)

    def descs(self, base: int, memory: Memory, chunk_bytes: int, num_chunks: int) -> object:
        """Descriptors of `num_chunks` chunks from `base` in `memory`: this agent's own pool or
        a peer's."""
        return self.agent.get_xfer_descs([(base + i * chunk_bytes, chunk_bytes, memory.device) for i in range(num_chunks)], memory.kind)

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)


def _gpu_pool(pool_bytes: int, device: int) -> Any:
    """A filled pool of `pool_bytes` on GPU `device`, through torch (imported only here: a CPU
    host measures DRAM alone)."""
    import torch

    if not torch.cuda.is_available() or device >= torch.cuda.device_count():
        raise SystemExit(f"VRAM{device}: this host's torch sees {torch.cuda.device_count() if torch.cuda.is_available() else 0} "
                         "GPU(s); measure DRAM here, or run on a GPU node with a CUDA build of torch")
    return torch.ones(pool_bytes, dtype=torch.uint8, device=f"cuda:{device}")


def _serve_pool(conn: Connection, pool_bytes: int, memory: Memory, threads: int) -> None:
    """The target in a process of its own, as a prefill engine is to the decode engine pulling
    from it: send the agent's metadata and pool address, then keep its worker progressing
    until told to stop."""
    target = _Agent(pool_bytes, memory, threads)
    try:
        conn.send((target.agent.get_agent_metadata(), target.base))
        while not conn.poll(0):
            target.agent.get_new_notifs()
    finally:
        target.close()


class _Target(msgspec.Struct, frozen=True):
    """What the reader knows of the target: its agent's name, pool address and memory, and how
    to make its worker progress when it shares the reader's thread (None: it progresses itself)."""

    name: str
    base: int
    memory: Memory
    poll: Callable[[], object] | None


@contextmanager
def _target(pool_bytes: int, memory: Memory, reader: _Agent, processes: int, threads: int) -> Iterator[_Target]:
    """The target agent, in the reader's process or (processes=2) a spawned one, added to the
    reader's peers."""
    if processes == 1:
        agent = _Agent(pool_bytes, memory, threads)
        try:
            name = reader.agent.add_remote_agent(agent.agent.get_agent_metadata())
            yield _Target(name, agent.base, memory, agent.agent.get_new_notifs)
            reader.agent.remove_remote_agent(name)
        finally:
            agent.close()
        return
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_serve_pool, args=(there, pool_bytes, memory, threads), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while not here.poll(0.5):
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the target process (pid {proc.pid}, exit code {proc.exitcode}) sent no agent metadata")
        metadata, base = here.recv()
        name = reader.agent.add_remote_agent(metadata)
        yield _Target(name, base, memory, None)
        reader.agent.remove_remote_agent(name)
    finally:
        if proc.is_alive():
            here.send("stop")
            proc.join(30)
        if proc.is_alive():
            proc.kill()


def _time_reads(reader: _Agent, target: _Target, chunk_bytes: int, num_chunks: int, iterations: int, warmup: int) -> list[float]:
    """Seconds per READ of `num_chunks` descriptors, from initiation to completion seen."""
    local = reader.descs(reader.base, reader.memory, chunk_bytes, num_chunks)
    remote = reader.descs(target.base, target.memory, chunk_bytes, num_chunks)
    handle = reader.agent.initialize_xfer("READ", local, remote, target.name)
    times = []
    try:
        for i in range(warmup + iterations):
            t0 = time.perf_counter()
            state = reader.agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                if target.poll is not None:
                    target.poll()  # the target's worker, in this same thread, needs progress too
                state = reader.agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed")
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        reader.agent.release_xfer_handle(handle)
    return times


def run_micro(
    geometry: KVGeometry, block_counts: Sequence[tuple[str, int]], iterations: int = 50, warmup: int = 5,
    reader_memory: Memory = Memory(), target_memory: Memory = Memory(), processes: int = 1, threads: int = 0,
) -> list[MicroResult]:
    """Time READs of each (label, number of blocks) between two fresh agents with `threads` UCX
    worker threads each, the reader's pool in `reader_memory` pulling from the target's in
    `target_memory`; the target in the reader's process, or (processes=2) in one of its own,
    as engines are."""
    if processes not in (1, 2):
        raise ValueError(f"processes={processes}: 1 (both agents in this process) or 2 (the target in its own)")
    max_chunks = 2 * geometry.num_layers * max(n for _, n in block_counts)
    pool = max_chunks * geometry.chunk_bytes
    reader = _Agent(pool, reader_memory, threads)
    path = f"{reader_memory} <- {target_memory}" + ("" if processes == 1 else ", two processes")
    path += f", {threads} UCX threads" if threads else ""
    try:
        with _target(pool, target_memory, reader, processes, threads) as target:
            results = []
            for label, n in block_counts:
                num_chunks = 2 * geometry.num_layers * n
                times = _time_reads(reader, target, geometry.chunk_bytes, num_chunks, iterations, warmup)
                results.append(MicroResult(
                    label=label,
                    num_blocks=n,
                    num_bytes=num_chunks * geometry.chunk_bytes,
                    num_descs=num_chunks,
                    iterations=iterations,
                    median_s=float(np.median(times)),
                    p90_s=float(np.percentile(times, 90)),
                    path=path,
                ))
            return results
    finally:
        reader.close()


def standard_sizes(geometry: KVGeometry, prompt_tokens: int, batch_bytes: int = 16 * 2**20) -> list[tuple[str, int]]:
    """One block, one prompt's blocks, and a batch of `batch_bytes` (the asymptotic bandwidth;
    16 MiB suits a host's memory, a GPU wants more)."""
    big = max(1, batch_bytes // geometry.block_bytes)
    return [("1 block", 1), (f"{prompt_tokens}-token prompt", geometry.num_blocks(prompt_tokens)), (f"{batch_bytes / 2**20:g} MiB", big)]


def markdown(results: Sequence[MicroResult]) -> str:
    """A table of the raw figures."""
    lines = ["| Transfer | Memory (reader <- target) | Blocks | Bytes | Descriptors | Median (ms) | p90 (ms) | GiB/s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| raw NIXL READ, {r.label} | {r.path} | {r.num_blocks} | {r.num_bytes:,} | {r.num_descs} "
                     f"| {1000 * r.median_s:.3f} | {1000 * r.p90_s:.3f} | {r.gib_per_s:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nixl_micro", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder holding config.json")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per KV block of the engines")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--batch-mib", type=float, default=16, help="the largest transfer, MiB (default %(default)s)")
    parser.add_argument("--paths", default="DRAM:DRAM", help="reader:target memory pairs, comma-separated: DRAM, VRAM<n> (default %(default)s)")
    parser.add_argument("--processes", type=int, choices=(1, 2), default=1,
                        help="2: the target agent in a process of its own, as a prefill engine is (default %(default)s)")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="UCX worker threads per agent (default: as engines get them, "
                             f"{GPU_NUM_THREADS} when a path names a GPU pool, else 0)")
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    try:
        paths = parse_paths(args.paths)
    except ValueError as e:
        parser.error(f"--paths: {e}")
    if args.num_threads is not None and args.num_threads < 0:
        parser.error(f"--num-threads {args.num_threads}: write 0 or more")
    on_gpu = any(m.kind == "VRAM" for pair in paths for m in pair)
    if on_gpu:
        for name, value in GPU_UCX_ENV.items():  # before UCX starts, here and in a target process
            os.environ.setdefault(name, value)
    threads = NixlConfig(num_threads=args.num_threads).worker_threads(on_gpu)
    geometry = KVGeometry.from_model(args.model, args.block_size)
    sizes = standard_sizes(geometry, args.prompt_tokens, int(args.batch_mib * 2**20))
    results = [r for reader, target in paths for r in run_micro(geometry, sizes, args.iterations, reader_memory=reader, target_memory=target,
                                                                          processes=args.processes, threads=threads)]
    print(markdown(results))
    if args.json:
        args.json.write_bytes(msgspec.json.encode({"geometry": geometry, "results": results}))


if __name__ == "__main__":
    main()
