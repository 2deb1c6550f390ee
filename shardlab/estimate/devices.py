"""The devices `estimate` and `search` know (`--device NAME|FILE`): the table in devices.toml (datasheet numbers, kept
as data so a device is added without code), a TOML or JSON file describing one more, or `cpu`, this machine as its
ranks share it (measured once, then cached)."""

from __future__ import annotations

import re
from importlib.resources import files
from pathlib import Path

import msgspec

from shardlab._errors import ShardlabError
from shardlab.estimate.cpu import cpu_device
from shardlab.estimate.device import Device
from shardlab.estimate.kernels import MEASURED

TABLE = "devices.toml"
"""Shipped in the package (pyproject.toml's package-data), read with importlib.resources."""
FILE_SUFFIXES = (".toml", ".json")
FIELDS = {
    "name": "the name estimates print, a string",
    "bf16_tflops": "the dense bf16 matmul peak in TFLOP/s, a number > 0",
    "fp8_tflops": "the dense float8 matmul peak in TFLOP/s, a number > 0 (leave it out: no float8 matmuls)",
    "memory_gib": "memory per device in GiB (nvidia-smi's total), a number > 0",
    "hbm_tb_s": "the HBM bandwidth in TB/s, a number > 0",
    "nvlink_gb_s": "the intra-node link bandwidth per device and direction in GB/s, a number > 0",
    "network_gb_s": "the inter-node network bandwidth per device and direction in GB/s, a number > 0",
    "power_w": "the power cap in W, a number > 0 (informational)",
    "matmul_efficiency": "achieved / peak matmul FLOP/s, a number in (0, 1] (default 0.8)",
    "hbm_efficiency": "achieved / peak HBM bandwidth, a number in (0, 1] (default 0.9)",
}
"""What a device file gives (name, the peaks and bandwidths, memory; fp8_tflops, power_w and the efficiencies may
be left out), and the fix a bad value names."""


def _table() -> dict[str, Device]:
    return msgspec.toml.decode((files("shardlab.estimate") / TABLE).read_bytes(), type=dict[str, Device])


DEVICES: dict[str, Device] = _table()


def device_file(path: Path) -> Device:
    """One device from a TOML or JSON file in Device's fields; a bad file or field is one line naming it and the fix."""
    where = f"--device {str(path)!r}"
    if path.suffix not in FILE_SUFFIXES:
        raise ShardlabError(f"{where}: a device file is .toml or .json, not {path.suffix or 'without a suffix'!r}")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ShardlabError(
            f"{where}: cannot read it ({err.strerror}); give a name or the path of a device file"
        ) from None
    decode = msgspec.toml.decode if path.suffix == ".toml" else msgspec.json.decode
    try:
        return decode(raw, type=Device)
    except msgspec.ValidationError as err:
        message = str(err)
        named = re.search(r"`\$\.(\w+)`|field `(\w+)`", message)
        field = next((g for g in named.groups() if g), "") if named else ""
        fix = FIELDS.get(field) or f"the fields are {', '.join(FIELDS)}"
        raise ShardlabError(f"{where}: {message}; {field + ': ' if field in FIELDS else ''}{fix}") from None
    except msgspec.DecodeError as err:
        raise ShardlabError(f"{where}: not valid {path.suffix[1:].upper()}: {err}") from None


def device(name: str, world: int = 1) -> Device:
    """A named device, or one read from a file (a name ending in .toml or .json); `cpu` is this machine as `world`
    ranks share it (measured once, then read from a cache)."""
    if name == "cpu":  # torch's _scaled_mm on a CPU is not measured apart: priced at the measured matmul rate
        dev = cpu_device(world)
        return dev if dev.fp8_tflops is not None else msgspec.structs.replace(dev, fp8_tflops=dev.bf16_tflops)
    if name.endswith(FILE_SUFFIXES):
        return device_file(Path(name))
    if name not in DEVICES:
        raise ShardlabError(
            f"--device {name!r} is unknown; choose one of {', '.join(DEVICES)}, cpu, or give a .toml or .json file "
            "describing one device (docs/estimate.md, Devices)"
        )
    dev = DEVICES[name]
    return dev if name not in MEASURED else msgspec.structs.replace(dev, kernels=MEASURED[name])
