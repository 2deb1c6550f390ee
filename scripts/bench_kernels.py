"""Measure a device's kernel table (shardlab.estimate.kernels) and print it as the estimator reads it.

    python scripts/bench_kernels.py --name h100                 # on a GPU: bf16, the GPU sizes
    python scripts/bench_kernels.py --device cpu --dtype float32 # this machine, one process

Times square matmuls, causal SDPA (forward + backward) and elementwise adds at several sizes, and a one-element add
(the cost of any op), and divides them by the device's datasheet peak and bandwidth (shardlab.estimate.roofline's
DEVICES entry for --name), or on a CPU by the fastest matmul and a large copy measured here. Paste the printed
entry into shardlab.estimate.kernels.MEASURED, under --name, to make `--device NAME` use it. For CPU ranks use
`--device cpu` of the estimator itself, which measures with every rank running at once.
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch

from shardlab.estimate.devices import DEVICES
from shardlab.estimate.kernels import measure, table, timer


def copy_bandwidth(device: torch.device, seconds: float) -> float:
    """Bytes read + written per second by a 256 MiB copy."""
    src = torch.empty(2**26, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / timer(device, seconds)(lambda: dst.copy_(src))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="cpu", help="the DEVICES entry whose datasheet peaks divide the rates")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--seconds", type=float, default=0.5, help="time each measurement at least this long")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda":
        print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", file=sys.stderr)
    rates = measure(timer(device, args.seconds), device, dtype)
    if args.name in DEVICES:
        peak, bandwidth = DEVICES[args.name].bf16_tflops * 1e12, DEVICES[args.name].hbm_tb_s * 1e12
    else:  # a measured device: its own best
        peak, bandwidth = max(r for _, r in rates.matmul), copy_bandwidth(device, args.seconds)
    kernels = table(rates, peak, bandwidth, "python " + shlex.join(sys.argv))
    print(f"# peak {peak / 1e12:.3f} TFLOP/s, bandwidth {bandwidth / 1e9:.1f} GB/s", file=sys.stderr)
    for name in ("matmul", "attention", "memory"):
        unit = "bytes" if name == "memory" else "FLOPs"
        points = ", ".join(f"{s:.3g} {unit}: {e:.3f}" for s, e in getattr(kernels, name))
        print(f"# {name}: {points}", file=sys.stderr)
    print(f"# per-op overhead {kernels.overhead_s * 1e6:.1f} us", file=sys.stderr)
    print(f"MEASURED[{args.name!r}] = {kernels!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
