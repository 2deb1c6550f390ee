"""The device table is data (shardlab/estimate/devices.toml, shipped as package data); `--device FILE` reads one more
device, and a bad file or field is one line naming it and the fix.

Run: pytest tests/test_devices.py (a few seconds; the CLI test runs one estimate of the debug model).
"""

import json
from pathlib import Path

import msgspec
import pytest

from shardlab._errors import ShardlabError
from shardlab.cli.main import main
from shardlab.estimate.device import Device
from shardlab.estimate.devices import DEVICES, FIELDS, TABLE, device, device_file
from shardlab.estimate.probe import Probe
from shardlab.estimate.roofline import compute_seconds, step_time
from shardlab.sharding.mesh import MeshSpec

ROOT = Path(__file__).resolve().parents[1]
DATASHEET = ("bf16_tflops", "memory_gib", "hbm_tb_s", "nvlink_gb_s", "network_gb_s", "power_w")
MINE = {"name": "My GPU", "bf16_tflops": 500, "fp8_tflops": 1000, "memory_gib": 64, "hbm_tb_s": 2.0,
        "nvlink_gb_s": 200, "network_gb_s": 25, "power_w": 400}  # fmt: skip


def test_every_table_entry_validates_and_gives_every_datasheet_number():
    raw = msgspec.toml.decode((ROOT / "shardlab" / "estimate" / TABLE).read_bytes())
    assert list(DEVICES) == list(raw) and {"h100", "h100-96gb-500w", "h200", "a100", "b200"} <= set(DEVICES)
    for name, dev in DEVICES.items():
        assert msgspec.convert(msgspec.to_builtins(dev), Device) == dev  # the checks of a decoded Device hold
        assert all(getattr(dev, field) is not None for field in DATASHEET), name
        assert set(raw[name]) <= set(FIELDS), name  # the table only uses what a device file may give
    assert DEVICES["a100"].fp8_tflops is None and all(d.fp8_tflops for n, d in DEVICES.items() if n != "a100")


def test_the_table_ships_as_package_data():
    pyproject = msgspec.toml.decode((ROOT / "pyproject.toml").read_bytes())
    assert TABLE in pyproject["tool"]["setuptools"]["package-data"]["shardlab.estimate"]


def test_torchtitans_h100_is_the_sxm5_silicon_at_its_published_bandwidth_and_memory():
    h100, capped = DEVICES["h100"], DEVICES["h100-96gb-500w"]
    assert (capped.hbm_tb_s, capped.power_w, capped.network_gb_s) == (2.4, 500, 50)  # torchtitan's benchmark page
    assert capped.memory_gib > h100.memory_gib
    # no derating for the cap: the peaks are the SXM5's (docs/estimate.md, "Devices")
    assert (capped.bf16_tflops, capped.fp8_tflops, capped.nvlink_gb_s) == (h100.bf16_tflops, h100.fp8_tflops, 450)


def write(path: Path, fields: dict) -> Path:
    """A device file: JSON, or TOML of scalar fields (None and empty ones left out, as TOML has no null)."""
    if path.suffix == ".json":
        path.write_text(json.dumps(fields))
    else:
        path.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in fields.items() if v not in (None, [], ())))
    return path


def ops_probe(ops) -> Probe:
    return Probe(collectives=(), flops=0, ops=tuple(ops), activation_bytes=0, block_activation_bytes=0)


def test_lower_hbm_bandwidth_slows_memory_bound_work_by_exactly_its_ratio():
    h100, capped = device("h100"), device("h100-96gb-500w")
    ratio = h100.hbm_tb_s / capped.hbm_tb_s
    memory_bound = ops_probe([(0, 10**9, 3, "memory"), (10**6, 10**9, 2, "matmul")])
    assert compute_seconds(memory_bound, capped) == pytest.approx(compute_seconds(memory_bound, h100) * ratio)
    compute_bound = ops_probe([(2 * 8192**3, 3 * 2 * 8192**2, 4, "matmul")])
    assert compute_seconds(compute_bound, capped) == pytest.approx(compute_seconds(compute_bound, h100))
    kwargs = dict(params_per_rank=10**9, global_tokens=8192, model_flops_per_token=1e9)
    mesh = MeshSpec(dp_shard=1)
    slow, fast = step_time(1.0, (), mesh, capped, **kwargs), step_time(1.0, (), mesh, h100, **kwargs)
    assert slow.optimizer_s == pytest.approx(fast.optimizer_s * ratio)  # AdamW streams its state through HBM


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_a_device_file_is_read(tmp_path, suffix):
    assert device(str(write(tmp_path / f"mine{suffix}", MINE))) == Device(**MINE)
    # an entry of the table, written out, reads back as the same device
    a100 = msgspec.to_builtins(DEVICES["a100"])
    assert device(str(write(tmp_path / f"a100{suffix}", a100))) == DEVICES["a100"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ({**MINE, "hbm_tb_s": 0}, r"Expected `float` > 0.0 - at `\$.hbm_tb_s`; hbm_tb_s: the HBM bandwidth in TB/s"),
        ({**MINE, "fp8_tflops": "fast"}, r"Expected `float \| null`, got `str` - at `\$.fp8_tflops`; fp8_tflops: the"),
        ({**MINE, "matmul_efficiency": 1.5}, r"`\$.matmul_efficiency`; matmul_efficiency: achieved / peak matmul"),
        ({k: v for k, v in MINE.items() if k != "memory_gib"}, r"missing required field `memory_gib`; memory_gib: "),
        ({**MINE, "hbm_gb_s": 2000}, r"unknown field `hbm_gb_s`; the fields are name, bf16_tflops, fp8_tflops"),
        ("name = \n", r"not valid TOML: "),
    ],
)
def test_a_bad_device_file_is_one_line_naming_the_field_and_the_fix(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text) if isinstance(text, str) else write(path, text)
    with pytest.raises(ShardlabError, match=r"^--device '.*bad\.toml': .*" + message) as err:
        device(str(path))
    assert "\n" not in str(err.value)


def test_a_missing_file_a_wrong_suffix_and_an_unknown_name_say_what_to_give(tmp_path):
    with pytest.raises(ShardlabError, match=r"cannot read it \(No such file or directory\); give a name or the path"):
        device(str(tmp_path / "nope.json"))
    with pytest.raises(ShardlabError, match=r"a device file is \.toml or \.json, not '\.yaml'"):
        device_file(tmp_path / "mine.yaml")
    with pytest.raises(ShardlabError, match=r"'tpu' is unknown; choose one of h100, h100-96gb-500w, h200, a100, b200,"):
        device("tpu")


def test_estimate_prices_a_device_given_as_a_file(tmp_path, capsys):
    path = write(tmp_path / "mine.toml", MINE)
    assert main(["estimate", "recipes/llama_debug.py", "--world", "1", "--device", str(path)]) == 0
    assert "on My GPU" in capsys.readouterr().out
    bad = write(tmp_path / "bad.json", {**MINE, "network_gb_s": -1})
    assert main(["estimate", "recipes/llama_debug.py", "--world", "1", "--device", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "network_gb_s: the inter-node network bandwidth" in err


def test_estimate_on_cpu_prices_the_machine_as_the_layouts_ranks_share_it(monkeypatch, capsys):
    """`--device cpu` is this machine measured with as many ranks as the layout has (they share its cores), not one."""
    import shardlab.estimate.devices as devices

    asked = []

    def measured(world: int):
        asked.append(world)
        return devices.device("h100")

    monkeypatch.setattr(devices, "cpu_device", measured)
    assert main(["estimate", "recipes/llama_fsdp.py", "--world", "2", "--device", "cpu"]) == 0
    assert asked == [2] and "step" in capsys.readouterr().out


def test_the_device_files_the_docs_use_are_valid():
    files = sorted((ROOT / "docs" / "devices").glob("*.toml"))
    assert files
    for path in files:
        assert device(str(path)).bf16_tflops > 0
