"""Kernel benchmark: eager PyTorch (TF32 off/on), torch.compile, and the fused op (plain: one launch; with a
workspace and a second kernel for the means, as graphs take it; TF32 mode; CUDA graph).

    python bench/kernel_bench.py [--out bench/results] [--iters 50]

Times are medians of CUDA-event timings; each timed call reads a different
input set, and the sets together exceed the L2 cache several times, so inputs
come from DRAM as in serving. Calls are timed in blocks of 10 back-to-back
calls (per-call time = block time / calls), which is what a server issuing
them sees. Floors: the fp32 FMA floor (the conv's FMAs over SMs x 128 lanes x
max SM clock) and the DRAM floor (input bytes over a measured device copy).
Writes bench/results/kernel-<device>.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
from pathlib import Path

import provenance  # bench/ (this script's folder)
import torch

from voxserve.kernels import cuda as cuda_kernels
from voxserve.kernels import fused_forward, reference, reference_float64, reference_weights
from voxserve.kernels.graphs import GraphCache

SHAPES = [(128, 3, 16, 32, 32), (1, 3, 16, 32, 32), (8, 3, 16, 32, 32), (32, 3, 32, 64, 64)]


def sm_clock_hz() -> float:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM) * 1e6
    except Exception:  # no NVML: the H100 SXM's max clock
        return 1.98e9


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    a = torch.empty(512 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() / statistics.median(times)


def time_fn(fn, inputs, iters: int, block: int) -> float:
    """Median seconds per call; `block` calls between two events, inputs rotated."""
    for i in range(3):
        fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    samples = []
    j = 0
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(block):
            fn(inputs[j % len(inputs)])
            j += 1
        e.record()
        e.synchronize()
        samples.append(s.elapsed_time(e) / 1e3 / block)
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--skip-compile", action="store_true", help="leave torch.compile out (it is slow to build)")
    parser.add_argument("--variants", default="0", help="comma-separated kernel variants to time (0 = default; "
                        f"others: {','.join(map(str, cuda_kernels.VARIANTS))})")
    parser.add_argument("--shapes", default=None, help="N,C,D,H,W;... (default: the four benchmark shapes)")
    parser.add_argument("--commit", default=None, help="the commit measured, for the report (default: "
                        "$VOXSERVE_COMMIT, else git's HEAD here)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    name = props.name
    clock = sm_clock_hz()
    fma_rate = props.multi_processor_count * 128 * clock
    bw = copy_bandwidth()
    l2 = getattr(props, "L2_cache_size", 50 * 1024 * 1024)
    w, b = (t.to(dev) for t in reference_weights())
    lib = cuda_kernels.library()
    print(f"device {name}: {props.multi_processor_count} SMs, SM clock {clock / 1e9:.2f} GHz, "
          f"fp32 FMA {fma_rate / 1e12:.1f} T/s, copy {bw / 1e12:.2f} TB/s, L2 {l2 / 2**20:.0f} MiB; "
          f"library {lib.path}", flush=True)

    compiled = None if args.skip_compile else torch.compile(reference)
    variants = [int(v) for v in args.variants.split(",")]
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")] if args.shapes else SHAPES
    rows = []
    for shape in shapes:
        n, cin, d, h, wd = shape
        voxels = n * (d - 2) * (h - 2) * (wd - 2)
        fmas = voxels * 16 * cin * 27
        in_bytes = n * cin * d * h * wd * 4
        sets = max(4, int(3 * l2 // in_bytes) + 1)
        inputs = [torch.randn(shape, device=dev) for _ in range(min(sets, 2048))]
        block = 10  # back-to-back calls: the host work of one call overlaps the GPU work of the previous
        fma_floor, dram_floor = fmas / fma_rate, in_bytes / (bw / 2)

        # correctness of every timed path on this shape, once
        ref = reference_float64(inputs[0], w, b)
        err = float((fused_forward(inputs[0], w, b).double().cpu() - ref).norm() / ref.norm())
        err_tf32 = float((fused_forward(inputs[0], w, b, "tf32").double().cpu() - ref).norm() / ref.norm())

        results = {}
        torch.backends.cudnn.allow_tf32 = False
        results["eager fp32"] = time_fn(lambda x: reference(x, w, b), inputs, args.iters, block)
        torch.backends.cudnn.allow_tf32 = True
        results["eager tf32"] = time_fn(lambda x: reference(x, w, b), inputs, args.iters, block)
        torch.backends.cudnn.allow_tf32 = False
        if compiled is not None:
            results["torch.compile"] = time_fn(lambda x: compiled(x, w, b), inputs, args.iters, block)
        for variant in variants:
            label = "fused" if variant == 0 else f"fused v{variant}"
            results[label] = time_fn(lambda x, v=variant: cuda_kernels.forward(x, w, b, v), inputs, args.iters,
                                     block)
        results["fused, 2 launches"] = time_fn(lambda x: cuda_kernels.forward(x, w, b, one_launch=False), inputs,
                                               args.iters, block)
        results["fused tf32"] = time_fn(lambda x: cuda_kernels.forward(x, w, b, 0, "tf32"), inputs, args.iters,
                                        block)
        halves = [x.half() for x in inputs]  # float16 input (the FP16 wire format), same values rounded
        results["fused fp16 in"] = time_fn(lambda x: cuda_kernels.forward(x, w, b), halves, args.iters, block)
        del halves
        cache = GraphCache(w, b, min_uses=1, max_input_bytes=1 << 40)
        cache.note(inputs[0])
        entry = cache.lookup(inputs[0])
        graph_inputs = inputs  # the graph reads its static buffer; staging is a device copy per call

        def graph_call(x, entry=entry):
            entry.stage(x)
            return entry.replay()

        results["fused graph"] = time_fn(graph_call, graph_inputs, args.iters, block)
        results["fused graph (replay only)"] = time_fn(lambda x, entry=entry: entry.replay(), graph_inputs,
                                                       args.iters, block)
        rows.append((shape, fma_floor, dram_floor, err, err_tf32, results, cuda_kernels.plan(inputs[0])["kernel"]))
        line = "  ".join(f"{k} {v * 1e6:8.1f} us" for k, v in results.items())
        print(f"{shape}: FMA floor {fma_floor * 1e6:.1f} us, DRAM floor {dram_floor * 1e6:.1f} us, "
              f"rel err {err:.1e} (tf32 {err_tf32:.1e})\n    {line}", flush=True)

    columns = list(rows[0][5])
    header = ("| shape | FMA floor | DRAM floor | " + " | ".join(columns)
              + " | fused rel. err | tf32 rel. err | fused kernel |")
    sep = "|" + "---|" * (len(columns) + 6)
    table = [header, sep]
    for shape, ff, df, err, err_tf32, res, kernel in rows:
        cells = " | ".join(f"{res[c] * 1e6:.1f}" for c in columns)
        table.append(f"| {'x'.join(map(str, shape))} | {ff * 1e6:.1f} | {df * 1e6:.1f} | {cells} | {err:.1e} "
                     f"| {err_tf32:.1e} | {kernel} |")
    text = "\n".join(table)
    print("\nmicroseconds per call (median)\n" + text)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = name.lower().replace("nvidia ", "").replace(" ", "-")
    path = out / f"kernel-{slug}.md"
    path.write_text(
        f"# Kernel benchmark on {name}\n\n"
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}\n"
        f"- command: `python bench/kernel_bench.py {' '.join(argv or sys.argv[1:])}`\n"
        f"- commit: {provenance.commit(args.commit)}\n"
        f"- device: {name}, {props.multi_processor_count} SMs, max SM clock {clock / 1e9:.2f} GHz, "
        f"measured copy bandwidth {bw / 1e12:.2f} TB/s (read + write)\n"
        f"- software: torch {torch.__version__}, CUDA {torch.version.cuda}, Python {platform.python_version()}\n"
        f"- timing: median of {args.iters} CUDA-event samples; inputs rotated over sets larger than 3x L2; "
        f"every shape timed as blocks of 10 back-to-back calls\n"
        f"- floors: FMA = conv FMAs / (SMs x 128 x clock); DRAM = input bytes / (copy bandwidth / 2)\n\n"
        f"Microseconds per call:\n\n{text}\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
