"""The devices `estimate` and `search` know by name (`--device`): datasheet numbers of GPUs, and `cpu`, this machine
as its ranks share it (measured once, then cached)."""

from __future__ import annotations

import msgspec

from shardlab._errors import ShardlabError
from shardlab.estimate.cpu import cpu_device
from shardlab.estimate.device import Device
from shardlab.estimate.kernels import MEASURED

DEVICES: dict[str, Device] = {
    "h100": Device(name="H100 SXM", bf16_tflops=989, fp8_tflops=1979, hbm_tb_s=3.35, nvlink_gb_s=450, network_gb_s=50,
                   memory_gib=79.6),
    "h200": Device(name="H200 SXM", bf16_tflops=989, fp8_tflops=1979, hbm_tb_s=4.8, nvlink_gb_s=450, network_gb_s=50,
                   memory_gib=140.4),
    "a100": Device(name="A100 SXM 80GB", bf16_tflops=312, hbm_tb_s=2.04, nvlink_gb_s=300, network_gb_s=25,
                   memory_gib=80),
    "b200": Device(name="B200", bf16_tflops=2250, fp8_tflops=4500, hbm_tb_s=8.0, nvlink_gb_s=900, network_gb_s=50,
                   memory_gib=179.1),
}  # fmt: skip
"""Network: 400 Gb/s InfiniBand per GPU (200 Gb/s HDR on A100 systems). Memory: nvidia-smi's total (81,559 MiB on
an H100 SXM, 143,771 on an H200, 81,920 on an A100 80GB, 183,359 on a B200). FP8: dense datasheet peaks; an A100 has
no float8 matmuls."""


def device(name: str, world: int = 1) -> Device:
    """A named device; `cpu` is this machine as `world` ranks share it (measured once, then read from a cache)."""
    if name == "cpu":  # torch's _scaled_mm on a CPU is not measured apart: priced at the measured matmul rate
        dev = cpu_device(world)
        return dev if dev.fp8_tflops is not None else msgspec.structs.replace(dev, fp8_tflops=dev.bf16_tflops)
    if name not in DEVICES:
        raise ShardlabError(f"--device {name!r} is unknown; choose one of {', '.join(DEVICES)}, cpu")
    dev = DEVICES[name]
    return dev if name not in MEASURED else msgspec.structs.replace(dev, kernels=MEASURED[name])
