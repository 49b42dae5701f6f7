import copy
import json
import re
from pathlib import Path

import pytest

from rigpilot.engine.hardware.specs import (
    DTYPES,
    GpuSpec,
    SpecTableError,
    load_specs,
    match_spec,
    spec_by_key,
)

from support.paths import REPO

MIB = 2**20

# (name as NVML / ROCm reports it, memory.total in MiB as the driver reports it, expected row).
# Memory figures are what real cards report: ECC on GDDR hides 1/16 (T4, A40, L40S), HBM parts
# keep a little back (H100 NVL 95830 MiB of "94 GB").
REAL_NAMES = [
    ("NVIDIA GeForce GTX 1080 Ti", 11264, "gtx-1080-ti"),
    ("NVIDIA GeForce RTX 3060", 12288, "rtx-3060-12gb"),
    ("NVIDIA GeForce RTX 3080", 10240, "rtx-3080-10gb"),
    ("NVIDIA GeForce RTX 3080", 12288, "rtx-3080-12gb"),
    ("NVIDIA GeForce RTX 3080 Ti", 12288, "rtx-3080-ti"),
    ("NVIDIA GeForce RTX 3090", 24576, "rtx-3090"),
    ("GeForce RTX 3090", 24268, "rtx-3090"),  # drivers before 2021 left off "NVIDIA"
    ("NVIDIA GeForce RTX 3090 Ti", 24564, "rtx-3090-ti"),
    ("NVIDIA GeForce RTX 4060 Ti", 16380, "rtx-4060-ti-16gb"),
    ("NVIDIA GeForce RTX 4070 Ti SUPER", 16376, "rtx-4070-ti-super"),
    ("NVIDIA GeForce RTX 4080", 16376, "rtx-4080"),
    ("NVIDIA GeForce RTX 4080 SUPER", 16376, "rtx-4080-super"),
    ("NVIDIA GeForce RTX 4090", 24564, "rtx-4090"),
    ("NVIDIA GeForce RTX 4090 D", 24564, "rtx-4090-d"),
    ("NVIDIA GeForce RTX 5080", 16303, "rtx-5080"),
    ("NVIDIA GeForce RTX 5090", 32607, "rtx-5090"),
    ("Quadro RTX 6000", 24576, "quadro-rtx-6000"),
    ("Quadro RTX 8000", 49152, "quadro-rtx-8000"),
    ("NVIDIA RTX A4000", 16376, "rtx-a4000"),
    ("NVIDIA RTX A5000", 24564, "rtx-a5000"),
    ("NVIDIA RTX A6000", 49140, "rtx-a6000"),
    ("NVIDIA A40", 46068, "a40"),
    ("NVIDIA RTX 4000 Ada Generation", 20475, "rtx-4000-ada"),
    ("NVIDIA RTX 5000 Ada Generation", 32760, "rtx-5000-ada"),
    ("NVIDIA RTX 6000 Ada Generation", 49140, "rtx-6000-ada"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 97887, "rtx-pro-6000-blackwell"),
    ("Tesla V100-SXM2-16GB", 16160, "v100-sxm2-16gb"),
    ("Tesla V100-SXM2-32GB", 32510, "v100-sxm2-32gb"),
    ("Tesla V100-DGXS-32GB", 32508, "v100-sxm2-32gb"),
    ("Tesla V100-PCIE-16GB", 16160, "v100-pcie-16gb"),
    ("Tesla V100-PCIE-32GB", 32510, "v100-pcie-32gb"),
    ("Tesla V100S-PCIE-32GB", 32510, "v100s-pcie-32gb"),
    ("Tesla T4", 15360, "t4"),
    ("NVIDIA A10", 23028, "a10"),
    ("NVIDIA A100-PCIE-40GB", 40960, "a100-pcie-40gb"),
    ("A100-SXM4-40GB", 40537, "a100-sxm4-40gb"),  # driver 450 style, no "NVIDIA"
    ("NVIDIA A100-SXM4-40GB", 40960, "a100-sxm4-40gb"),
    ("NVIDIA A100 80GB PCIe", 81920, "a100-pcie-80gb"),
    ("NVIDIA A100-SXM4-80GB", 81920, "a100-sxm4-80gb"),
    ("NVIDIA L4", 23034, "l4"),
    ("NVIDIA L40S", 46068, "l40s"),
    ("NVIDIA H100 PCIe", 81559, "h100-pcie"),
    ("NVIDIA H100 80GB HBM3", 81559, "h100-sxm5"),
    ("NVIDIA H100 NVL", 95830, "h100-nvl"),
    ("NVIDIA H200", 143771, "h200-sxm"),
    ("NVIDIA H200 NVL", 143771, "h200-nvl"),
    ("NVIDIA B200", 183359, "b200"),
    ("AMD Instinct MI250X", 65520, "mi250x"),
    ("AMD Instinct MI250", 65520, "mi250"),
    ("AMD Instinct MI250X / MI250", 65520, "mi250"),
    ("AMD Instinct MI300X", 196592, "mi300x"),
]

# Names several rows claim on purpose; only the memory size tells them apart.
SHARED_BY_SIZE = {"NVIDIA GeForce RTX 3080"}

REQUIRED_KEYS = {
    "rtx-3060-12gb", "rtx-3080-10gb", "rtx-3080-ti", "rtx-3090", "rtx-3090-ti", "rtx-4060-ti-16gb",
    "rtx-4070-ti-super", "rtx-4080", "rtx-4080-super", "rtx-4090", "rtx-5080", "rtx-5090",
    "rtx-a4000", "rtx-a5000", "rtx-a6000", "rtx-4000-ada", "rtx-5000-ada", "rtx-6000-ada", "rtx-pro-6000-blackwell",
    "v100-sxm2-16gb", "v100-sxm2-32gb", "v100-pcie-16gb", "v100s-pcie-32gb",
    "a100-pcie-40gb", "a100-sxm4-40gb", "a100-pcie-80gb", "a100-sxm4-80gb",
    "h100-pcie", "h100-sxm5", "h100-nvl", "h200-sxm", "b200", "l4", "l40s", "a10", "t4",
    "mi250", "mi250x", "mi300x", "quadro-rtx-6000",
}  # fmt: skip

TENSOR_ARCHS = {"Ampere", "Ada Lovelace", "Hopper", "Blackwell"}
FP8_ARCHS = {"Ada Lovelace", "Hopper", "Blackwell", "CDNA 3"}
CC_BY_ARCH = {
    "Pascal": {"6.0", "6.1"},
    "Volta": {"7.0"},
    "Turing": {"7.5"},
    "Ampere": {"8.0", "8.6"},
    "Ada Lovelace": {"8.9"},
    "Hopper": {"9.0"},
    "Blackwell": {"10.0", "12.0"},
}


@pytest.fixture(scope="module")
def specs() -> list[GpuSpec]:
    return load_specs()


def claimants(specs: list[GpuSpec], name: str) -> list[GpuSpec]:
    return [s for s in specs if any(re.search(p, name, re.IGNORECASE) for p in s.match)]


# ---- the shipped table --------------------------------------------------------------------------------


def test_table_has_the_required_products(specs):
    keys = {s.key for s in specs}
    assert len(specs) >= 34
    assert REQUIRED_KEYS <= keys, REQUIRED_KEYS - keys


@pytest.mark.parametrize(("name", "mib", "key"), REAL_NAMES, ids=[f"{n}-{m}" for n, m, _ in REAL_NAMES])
def test_real_names_map_to_their_row(name, mib, key):
    assert match_spec(name, mib * MIB).key == key
    if name not in SHARED_BY_SIZE:
        assert match_spec(name).key == key  # the name alone is enough


def test_enough_distinct_real_names_and_every_row_is_reachable(specs):
    assert len({name for name, _, _ in REAL_NAMES}) >= 30
    assert {key for _, _, key in REAL_NAMES} == {s.key for s in specs}


def test_no_two_rows_claim_the_same_name(specs):
    for name, _, _ in REAL_NAMES:
        owners = claimants(specs, name)
        if name in SHARED_BY_SIZE:
            assert len({s.memory_gib for s in owners}) == len(owners) > 1, name
        else:
            assert [s.key for s in owners] == [match_spec(name).key], name


def test_a100_size_comes_from_memory_when_the_name_omits_it():
    assert match_spec("NVIDIA A100-PCIe", 40960 * MIB).key == "a100-pcie-40gb"
    assert match_spec("NVIDIA A100-PCIe", 81920 * MIB).key == "a100-pcie-80gb"
    assert match_spec("NVIDIA A100-SXM4", 40537 * MIB).key == "a100-sxm4-40gb"
    assert match_spec("NVIDIA A100-SXM4", 81251 * MIB).key == "a100-sxm4-80gb"
    # The size in the name must agree with the memory reported.
    assert match_spec("NVIDIA A100-SXM4-40GB", 81920 * MIB) is None


def test_h100_sxm_pcie_and_nvl_are_different_rows():
    sxm, pcie, nvl = (match_spec(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL"))
    assert (sxm.form_factor, sxm.memory_bandwidth_gbs, sxm.nvlink_bandwidth_gbs) == ("SXM5", 3350, 900)
    assert pcie.memory_bandwidth_gbs == 2000 and pcie.tdp_w == 350
    assert nvl.memory_gib == 94 and nvl.memory_bandwidth_gbs == 3900


def test_v100_sxm2_16_and_32gb():
    assert match_spec("Tesla V100-SXM2-16GB", 16160 * MIB).memory_gib == 16
    assert match_spec("Tesla V100-SXM2-32GB", 32510 * MIB).memory_gib == 32
    assert match_spec("Tesla V100-SXM2-16GB", 32510 * MIB) is None


def test_rtx_6000_family_is_not_confused():
    assert match_spec("NVIDIA RTX 6000 Ada Generation").architecture == "Ada Lovelace"
    assert match_spec("Quadro RTX 6000").architecture == "Turing"
    assert match_spec("NVIDIA RTX A6000").architecture == "Ampere"
    assert match_spec("NVIDIA RTX PRO 6000 Blackwell Workstation Edition").architecture == "Blackwell"
    assert match_spec("NVIDIA GeForce RTX 4090").key == "rtx-4090"
    assert match_spec("NVIDIA GeForce RTX 4090 D").key == "rtx-4090-d"


@pytest.mark.parametrize(
    ("name", "mib"),
    [
        ("NVIDIA GeForce RTX 4090 Laptop GPU", 16376),  # a different, much slower part
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", 4864),  # a MIG slice, not the whole GPU
        ("NVIDIA GeForce RTX 2080 Ti", 11264),
        ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", 97887),
        ("NVIDIA GeForce RTX 4060 Ti", 8188),  # the 8 GB card: same name, no row
        ("", None),
        ("   ", None),
    ],
)
def test_unknown_gpus_give_none(name, mib):
    assert match_spec(name, None if mib is None else mib * MIB) is None


def test_matching_ignores_case_and_stray_whitespace():
    assert match_spec("  nvidia  geforce RTX 4090 \n").key == "rtx-4090"
    assert match_spec("NVIDIA GeForce RTX 3080", 0).key == "rtx-3080-10gb"  # 0 = unknown: first listed


def test_the_most_specific_pattern_wins(tmp_path):
    generic = _row(key="any-geforce", match=["GeForce RTX"], memory_gib=24)
    exact = _row(key="exact-4090", match=[r"GeForce RTX 4090$"], memory_gib=24)
    for table in ([generic, exact], [exact, generic]):
        specs = load_specs(_write(tmp_path, table, name=f"t{table[0]['key']}.json"))
        assert match_spec("NVIDIA GeForce RTX 4090", specs=specs).key == "exact-4090"
        assert match_spec("NVIDIA GeForce RTX 2080", specs=specs).key == "any-geforce"


def test_sanity_invariants(specs):
    for s in specs:
        assert s.memory_gib > 0 and s.memory_bandwidth_gbs > 0 and s.fp32_tflops > 0 and s.tdp_w > 0, s.key
        assert s.source.strip() and "https://" in s.source, s.key
        assert s.match, s.key
        if s.vendor == "NVIDIA":
            assert s.compute_capability in CC_BY_ARCH[s.architecture], s.key
        else:
            assert s.compute_capability is None, s.key
        if s.vendor == "NVIDIA" and s.architecture in TENSOR_ARCHS:
            assert s.tf32_tflops and s.bf16_tflops and s.fp16_tflops and s.int8_tops, s.key
            assert s.bf16_tflops >= s.fp32_tflops and s.tf32_tflops >= s.fp32_tflops, s.key
        if s.vendor == "NVIDIA" and s.architecture not in TENSOR_ARCHS:
            assert s.bf16_tflops is None and s.tf32_tflops is None, s.key
        if s.bf16_tflops is not None:
            assert s.bf16_tflops >= s.fp32_tflops, s.key
            # Same tensor rate for both 16-bit formats at FP32 accumulate; a mismatch means mixed conventions.
            assert s.bf16_tflops == s.fp16_tflops, s.key
        assert (s.fp8_tflops is not None) == (s.architecture in FP8_ARCHS), s.key
        if s.fp8_tflops is not None:
            assert s.fp8_tflops >= s.fp16_tflops, s.key
        if s.fp16_tflops is not None and s.tf32_tflops is not None:
            assert s.fp16_tflops >= s.tf32_tflops, s.key
        assert (s.nvlink_gen is None) == (s.nvlink_bandwidth_gbs is None), s.key


def test_dense_figures_not_sparsity():
    # Each would be double if a "with sparsity" marketing figure had slipped in.
    assert spec_by_key("h100-sxm5").bf16_tflops == pytest.approx(989.5)
    assert spec_by_key("h100-sxm5").fp8_tflops == pytest.approx(1979)
    assert spec_by_key("a100-sxm4-80gb").bf16_tflops == 312
    assert spec_by_key("l4").fp8_tflops == pytest.approx(242.5)
    assert spec_by_key("b200").bf16_tflops == 2250
    assert spec_by_key("mi300x").fp16_tflops == pytest.approx(1307.4)
    # GeForce at FP32 accumulate: half the FP16-accumulate rate the box quotes.
    assert spec_by_key("rtx-4090").fp16_tflops == pytest.approx(165.2)
    assert spec_by_key("rtx-3090").bf16_tflops == pytest.approx(71.2)


def test_nvlink_bridges():
    for key in ("rtx-3090", "rtx-a6000", "rtx-a5000"):
        assert spec_by_key(key).nvlink_bandwidth_gbs == 112.5
    assert spec_by_key("rtx-4090").nvlink_bandwidth_gbs is None
    assert spec_by_key("a100-sxm4-80gb").nvlink_bandwidth_gbs == 600
    assert spec_by_key("b200").nvlink_bandwidth_gbs == 1800


# ---- the API ------------------------------------------------------------------------------------------


def test_peak_tflops():
    a100 = spec_by_key("a100-sxm4-80gb")
    assert [a100.peak_tflops(d) for d in DTYPES] == [19.5, 156, 312, 312, None, 624]
    assert a100.peak_tflops("bfloat16") == a100.peak_tflops("BF16") == 312
    assert spec_by_key("v100-sxm2-32gb").peak_tflops("bf16") is None
    assert spec_by_key("v100-sxm2-32gb").peak_tflops("float16") == 125
    with pytest.raises(ValueError, match="unknown dtype 'fp4'"):
        a100.peak_tflops("fp4")


def test_spec_by_key_suggests_close_keys():
    assert spec_by_key("rtx-4090").name == "GeForce RTX 4090"
    with pytest.raises(KeyError, match="rtx-4090"):
        spec_by_key("rtx-409")
    with pytest.raises(KeyError, match="h100-sxm5"):
        spec_by_key("h100-sxm")


def test_load_specs_is_cached_and_rereads_an_edited_file(tmp_path):
    path = _write(tmp_path, [_row()])
    first = load_specs(path)
    assert load_specs(path) == first and load_specs(path) is not first  # a copy: callers may mutate it
    _write(tmp_path, [_row(), _row(key="second", match=["Second$"])])
    assert [s.key for s in load_specs(path)] == ["rtx-4090", "second"]


# ---- malformed tables ---------------------------------------------------------------------------------

_VALID = json.loads(REPO.joinpath("resources", "gpu_specs.json").read_text())


def _row(**changes):
    row = copy.deepcopy(next(r for r in _VALID["gpus"] if r["key"] == "rtx-4090"))
    row.update(changes)
    return row


def _write(tmp_path: Path, rows, name="specs.json", **top) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"schema_version": 1, "gpus": rows, **top}))
    return path


def _without(field):
    row = _row()
    del row[field]
    return row


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (_without("memory_bandwidth_gbs"), "missing field(s) memory_bandwidth_gbs"),
        (_without("source"), "missing field(s) source"),
        (_row(fp16_tflops=-165.2), "fp16_tflops must be positive"),
        (_row(memory_gib=0), "memory_gib must be positive"),
        (_row(fp32_tflops="82.6"), "fp32_tflops must be a number"),
        (_row(tdp_w=True), "tdp_w must be a number"),
        (_row(fp32_tflops=None), "fp32_tflops must be a number"),
        (_row(pcie_gen=4.0), "pcie_gen must be an integer"),
        (_row(match=["GeForce RTX (4090"]), "is not a valid regex"),
        (_row(match=[".*"]), "matches the empty string"),
        (_row(match=[]), "match must be a non-empty list"),
        (_row(match="GeForce RTX 4090$"), "match must be a non-empty list"),
        (_row(fp16_tflop=165.2), "unknown field(s) fp16_tflop"),
        (_row(nvlink_gen=4), "nvlink_gen and nvlink_bandwidth_gbs must both be set"),
        (_row(compute_capability=None), "compute_capability must be"),
        (_row(compute_capability=8.9), "compute_capability must be"),
        (_row(vendor="AMD"), "compute_capability is a CUDA notion"),
        (_row(source="NVIDIA Ada whitepaper"), "source must name the datasheet and give its URL"),
        (_row(name=""), "name must be a non-empty string"),
    ],
)
def test_malformed_rows_are_rejected_naming_the_row(tmp_path, row, message):
    path = _write(tmp_path, [_row(key="fine", match=["Fine$"]), row])
    with pytest.raises(SpecTableError) as info:
        load_specs(path)
    text = str(info.value)
    assert "specs.json: row 1 (key 'rtx-4090')" in text
    assert message in text


def test_bad_key_duplicate_key_and_indistinguishable_rows(tmp_path):
    with pytest.raises(SpecTableError, match=r"row 0 \(key 'RTX 4090'\): key must be lower-case"):
        load_specs(_write(tmp_path, [_row(key="RTX 4090")], name="a.json"))
    with pytest.raises(SpecTableError, match=r"row 1 \(key 'rtx-4090'\): duplicate key \(also row 0\)"):
        load_specs(_write(tmp_path, [_row(), _row(match=["Other$"])], name="b.json"))
    with pytest.raises(SpecTableError, match=r"share match pattern .* and the same memory size"):
        load_specs(_write(tmp_path, [_row(), _row(key="twin")], name="c.json"))
    # Sharing a pattern is fine when memory tells the rows apart.
    assert len(load_specs(_write(tmp_path, [_row(), _row(key="big", memory_gib=48)], name="d.json"))) == 2


def test_malformed_files_are_rejected(tmp_path):
    (tmp_path / "broken.json").write_text('{"schema_version": 1, "gpus": [')
    with pytest.raises(SpecTableError, match=r"broken\.json: not valid JSON"):
        load_specs(tmp_path / "broken.json")
    with pytest.raises(SpecTableError, match='"gpus" list'):
        load_specs(_write(tmp_path, {"rtx-4090": _row()}, name="e.json"))
    path = tmp_path / "f.json"
    path.write_text(json.dumps({"schema_version": 2, "gpus": [_row()]}))
    with pytest.raises(SpecTableError, match="schema_version 2 is not 1"):
        load_specs(path)
    with pytest.raises(SpecTableError, match=r"row 0 \(no key\): expected an object"):
        load_specs(_write(tmp_path, ["rtx-4090"], name="g.json"))
