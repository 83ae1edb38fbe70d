"""The merge of one round read from its encoded contributions.

Per cell: one fragment of 1 MB to 1 GB of float32 (four leaves), M = 4 contributions as they
come off the wire (bfloat16, or int4 in blocks of 64), in a fresh process pinned to one core.
A merge takes the contributions from their arrival to one outer gradient:

- `decoded` (the synchronizer's former path): each contribution decoded onto its base as it
  arrives (`wire.decode_add`, which also measures the norm guard's figures), kept as float32,
  then `merge.scaled_outer_gradient` with the guard's norms (RDA).
- `streamed` (`sync_core`'s path, `algorithm/stream_merge.py`): each contribution's norms
  measured as it arrives without keeping its values (`arrival_norms`), kept encoded, then
  `stream_outer_gradient`, which decodes it again one chunk at a time (here on a float32
  base; the synchronizer now keeps bases in bfloat16 and widens them per chunk).
- `jax` (only to compare kernels, not shipped): the second pass as one jitted XLA CPU
  kernel over whole leaves (decode, add to the base, subtract from G, weight, sum: fused),
  on one thread, against the same pass in NumPy (`numpy_pass_s`).

Throughput is GB (1e9 bytes) of float32 contributions (4 bytes a parameter per contribution,
as `benchmarks/results/synchronizer.json` counts them) per CPU second of that process
(`time.process_time`; the machine is shared, the wall clock is in the JSON too), median over
rounds. Peak working memory is tracemalloc's peak over one merge beyond its result (the
fragment-sized outer gradient) and the inputs present before it (global value, base, wire
bytes): for `decoded`, the float32 contributions it holds. Target: >= 1 GB/s at every size.

    python benchmarks/stream_merge.py            # 1, 16, 256, 1024 MB x bfloat16, int4
    python benchmarks/stream_merge.py --quick    # 1, 16 MB
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
import tracemalloc
from typing import Any

import numpy as np

from common import parser, write_results

TARGET_GB_S = 1.0
LEARNERS = 4
LEAVES = 4
BLOCK = 64
JAX_MB = (16, 256)  # the sizes the XLA kernel is compared at
MB = 2**20


def _inputs(mb: int, wire_dtype: str) -> tuple[dict, dict, dict, list[float]]:
    from ray_diloco.algorithm import wire

    n = mb * MB // 4 // LEAVES
    rng = np.random.default_rng(0)
    g = {f"layer_{i}": rng.normal(0, 0.02, n).astype(np.float32) for i in range(LEAVES)}
    base = {k: v + rng.normal(0, 1e-3, n).astype(np.float32) for k, v in g.items()}
    # One delta, sent by every learner: the work per byte does not depend on the values.
    delta = {
        k: wire.encode(rng.normal(0, 1e-3, n).astype(np.float32), wire_dtype, BLOCK)  # type: ignore[arg-type]
        for k in g
    }
    weights = [1.0 + i for i in range(LEARNERS)]
    return g, base, delta, weights


def _decoded(g: dict, base: dict, delta: dict, weights: list[float]) -> dict:
    from ray_diloco.algorithm import merge, wire

    held = []
    for _ in weights:
        theta, sq = {}, {}
        for k, e in delta.items():
            theta[k], sq[k], _own = wire.decode_add(e, base[k], g[k])
        held.append((theta, sq))
    contributions = [(theta, w) for (theta, _), w in zip(held, weights, strict=True)]
    return merge.scaled_outer_gradient(g, contributions, (), "rda", [sq for _, sq in held])


def _streamed(g: dict, base: dict, delta: dict, weights: list[float], chunk: int) -> dict:
    from ray_diloco.algorithm.stream_merge import Streamed, arrival_norms, stream_outer_gradient

    sq = [{k: arrival_norms(e, base[k], g[k])[0] for k, e in delta.items()} for _ in weights]
    contributions = [(Streamed(delta, base), w) for w in weights]
    return stream_outer_gradient(g, contributions, (), "rda", sq, chunk)


def _timed(fn: Any, rounds: int) -> tuple[list[float], list[float]]:
    cpu, wall = [], []
    for _ in range(rounds):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return cpu, wall


def _peak(fn: Any, result_bytes: int) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] - result_bytes
    finally:
        tracemalloc.stop()


def _jax_pass(
    g: dict, base: dict, delta: dict, coefs: list[float], rounds: int
) -> tuple[list[float], list[float]]:
    """The combine pass as one fused XLA kernel per whole leaf, CPU seconds per round: from
    the host buffers (each round hands XLA its inputs and takes the result back) and with
    the inputs already placed (the kernel alone)."""
    import jax
    import jax.numpy as jnp

    def decode(payload: Any, scales: Any, n: int, dtype: str) -> Any:
        if dtype == "bfloat16":
            return jax.lax.bitcast_convert_type(payload.astype(jnp.uint32) << 16, jnp.float32)
        lo = (payload & 15).astype(jnp.int8)
        hi = (payload >> 4).astype(jnp.int8)
        q = jnp.stack([lo, hi], axis=-1).reshape(-1)
        q = jnp.where(q > 7, q - 16, q).astype(jnp.float32)
        return (q.reshape(-1, BLOCK) * scales[:, None]).reshape(-1)[:n]

    def kernel(gl: Any, bl: Any, payloads: Any, scales: Any, cs: Any, dtype: str) -> Any:
        acc = jnp.zeros_like(gl)
        for i, (pl, sc) in enumerate(zip(payloads, scales, strict=True)):
            acc = acc + (gl - (bl + decode(pl, sc, gl.size, dtype))) * cs[i]
        return acc

    leaf = next(iter(delta.values()))
    fn = jax.jit(kernel, static_argnums=5)
    # One buffer per contribution, as M learners' offers are: XLA may not read one for all.
    host = {}
    for k, e in delta.items():
        bits = np.frombuffer(e.payload, np.uint16 if e.dtype == "bfloat16" else np.uint8)
        scales = np.frombuffer(e.scales, np.float32) if e.scales else np.zeros(1, np.float32)
        host[k] = (g[k], base[k], [bits.copy() for _ in coefs], [scales.copy() for _ in coefs])

    def to_xla(k: str) -> tuple[Any, ...]:
        gl, bl, bits, scales = host[k]
        return (
            jnp.asarray(gl),
            jnp.asarray(bl),
            tuple(map(jnp.asarray, bits)),
            tuple(map(jnp.asarray, scales)),
        )

    cs = jnp.asarray(coefs, jnp.float32)
    placed = {k: to_xla(k) for k in host}
    for a in placed.values():
        fn(*a, cs, leaf.dtype).block_until_ready()  # compile
    cpu, kernel_cpu = [], []
    for _ in range(rounds):
        c0 = time.process_time()
        for k in host:  # from the host buffers, as the merge gets them
            np.asarray(fn(*to_xla(k), cs, leaf.dtype))
        cpu.append(time.process_time() - c0)
        c0 = time.process_time()
        for a in placed.values():  # the inputs already XLA buffers: the kernel alone
            fn(*a, cs, leaf.dtype).block_until_ready()
        kernel_cpu.append(time.process_time() - c0)
    return cpu, kernel_cpu


def _numpy_pass(
    g: dict, base: dict, delta: dict, coefs: list[float], rounds: int, chunk: int
) -> list[float]:
    from ray_diloco.algorithm.stream_merge import _combine, _Source

    def once() -> None:
        for k, e in delta.items():
            srcs = [_Source(e, base[k], None, g[k]) for _ in coefs]
            _combine(srcs, coefs, g[k].size, chunk)

    return _timed(once, rounds)[0]


def cell(mb: int, wire_dtype: str, chunk: int, rounds: int) -> list[dict[str, Any]]:
    """Both paths on one fragment, in this process (pin it to one core first)."""
    g, base, delta, weights = _inputs(mb, wire_dtype)
    contributed = LEARNERS * mb * MB  # float32 bytes of the contributions
    wire_bytes = LEARNERS * sum(e.nbytes for e in delta.values())
    result = mb * MB
    rows = []
    runs = {
        "decoded": lambda: _decoded(g, base, delta, weights),
        "streamed": lambda: _streamed(g, base, delta, weights, chunk),
    }
    for path, fn in runs.items():
        fn()  # warm: pages and caches, as in a running synchronizer
        cpu, wall = _timed(fn, rounds)
        peak = _peak(fn, result)
        rows.append(
            {
                "fragment_mb": mb,
                "wire": wire_dtype,
                "path": path,
                "learners": LEARNERS,
                "rounds": rounds,
                "chunk": chunk if path == "streamed" else None,
                "cpu_s": statistics.median(cpu),
                "wall_s": statistics.median(wall),
                "gb_per_s": contributed / 1e9 / statistics.median(cpu),
                "wire_gb_per_s": wire_bytes / 1e9 / statistics.median(cpu),
                "peak_mb": peak / MB,
                "peak_bytes_per_param": peak / (mb * MB / 4),
            }
        )
    if mb in JAX_MB:
        coefs = [w / sum(weights) for w in weights]
        jax_cpus, kernel_cpus = _jax_pass(g, base, delta, coefs, rounds)
        jax_cpu, kernel_cpu = statistics.median(jax_cpus), statistics.median(kernel_cpus)
        numpy_cpu = statistics.median(_numpy_pass(g, base, delta, coefs, rounds, chunk))
        rows.append(
            {
                "fragment_mb": mb,
                "wire": wire_dtype,
                "path": "jax",
                "learners": LEARNERS,
                "rounds": rounds,
                "jax_pass_s": jax_cpu,
                "numpy_pass_s": numpy_cpu,
                "jax_pass_gb_per_s": contributed / 1e9 / jax_cpu,
                "jax_kernel_s": kernel_cpu,
                "jax_kernel_gb_per_s": contributed / 1e9 / kernel_cpu,
                "numpy_pass_gb_per_s": contributed / 1e9 / numpy_cpu,
            }
        )
    return rows


def _pinned(args: tuple[int, str, int, int]) -> list[dict[str, Any]]:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    # One XLA thread, as one NumPy thread: the comparison is per core.
    os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    os.environ["JAX_PLATFORMS"] = "cpu"
    return cell(*args)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--chunk", type=int, default=None, help="elements per streamed chunk")
    p.add_argument("--sizes", type=int, nargs="*", default=None, help="fragment sizes in MB")
    args = p.parse_args()
    from ray_diloco.algorithm.chunks import CHUNK

    chunk = args.chunk or CHUNK
    sizes = args.sizes or ([1, 16] if args.quick else [1, 16, 256, 1024])
    rows: list[dict[str, Any]] = []
    ctx = multiprocessing.get_context("spawn")
    for mb in sizes:
        for wire_dtype in ("bfloat16", "int4"):
            # The largest sizes once (a round of 4 GB of contributions takes seconds: stable).
            rounds = max(2, min(10, 256 // mb)) if mb < 1024 else 1
            load = os.getloadavg()[0]
            with ctx.Pool(1) as pool:  # a fresh process per cell: no memory carried over
                got = pool.apply(_pinned, ((mb, wire_dtype, chunk, rounds),))
            for row in got:
                row["load"] = load
                print({k: v for k, v in row.items() if v is not None}, flush=True)
            rows += got
    merges = [r for r in rows if r["path"] != "jax"]
    streamed = [r["gb_per_s"] for r in merges if r["path"] == "streamed"]
    columns = [
        "fragment_mb",
        "wire",
        "path",
        "gb_per_s",
        "wire_gb_per_s",
        "peak_mb",
        "peak_bytes_per_param",
        "cpu_s",
        "wall_s",
        "rounds",
        "load",
    ]
    meta = {
        "target_gb_per_s": TARGET_GB_S,
        "learners": LEARNERS,
        "int4_block_size": BLOCK,
        "chunk": chunk,
        "min_streamed_gb_per_s": min(streamed) if streamed else None,
        "target_met": bool(streamed) and min(streamed) >= TARGET_GB_S,
        "load_average": os.getloadavg(),
        "jax": [r for r in rows if r["path"] == "jax"],
    }
    name = "stream_merge-quick" if args.quick else "stream_merge"
    md = write_results(args.out, name, merges, columns, meta)
    jax_rows = [r for r in rows if r["path"] == "jax"]
    if jax_rows:
        from ray_diloco.observe.report import markdown_table

        table = markdown_table(
            jax_rows,
            [
                "fragment_mb",
                "wire",
                "numpy_pass_gb_per_s",
                "jax_pass_gb_per_s",
                "jax_kernel_gb_per_s",
                "rounds",
                "load",
            ],
        )
        print(table)
        with md.open("a") as f:
            f.write(
                f"\nThe combine pass alone, NumPy chunks against one fused XLA kernel:\n\n{table}\n"
            )


if __name__ == "__main__":
    main()
