"""Every report says which machine measured it (issue 50): the machine block names the CPU,
its kernel-deciding ISA features, caches and torch's CPU build; the parsers read canned OS
text (an AVX2 host, an AVX-512 + AMX host, an Arm host, two Macs); hosts compare by ISA
class, and a block from before these keys reads as "not recorded". Nothing is timed."""
from __future__ import annotations

import platform
from pathlib import Path

import pytest

from tinyserve import provenance as p
from tinyserve.workbook import course_runs

# /proc/cpuinfo's first entries, trimmed: an AVX2 cloud VM (AMD Milan), an AVX-512 + AMX
# one (Intel Sapphire Rapids) and an Arm one (Graviton3, Neoverse-V1: no model name).
AVX2_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c bmi1 avx2 smep bmi2 sha_ni
cache size\t: 512 KB

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu avx avx2 fma
"""
AMX_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480C
flags\t\t: fpu sse sse2 fma avx avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx_vnni \
avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg amx_bf16 avx512_fp16 amx_tile \
amx_int8
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics asimddp sha512 sve asimdfhm \
svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1
"""
APPLE_SYSCTL = """machdep.cpu.brand_string: Apple M2 Pro
hw.l2cachesize: 4194304
hw.optional.neon: 1
hw.optional.AdvSIMD: 1
hw.optional.arm.FEAT_DotProd: 1
hw.optional.arm.FEAT_I8MM: 0
hw.optional.arm.FEAT_BF16: 1
hw.optional.arm.FEAT_SME: 0
"""
INTEL_MAC_SYSCTL = """machdep.cpu.brand_string: Intel(R) Core(TM) i9-9880H CPU @ 2.30GHz
machdep.cpu.vendor: GenuineIntel
hw.l2cachesize: 262144
hw.l3cachesize: 16777216
hw.optional.avx2_0: 1
hw.optional.fma: 1
hw.optional.avx512f: 0
"""
TORCH = {"torch_cpu_capability": "AVX512", "torch_blas": "MKL", "onednn": True,
         "cpu_count": 2, "torch_threads": 1, "torch": "2.13.0"}


def block(cpuinfo: str, **extra: object) -> dict:
    """A machine block as machine_info() writes it, for a host described by ``cpuinfo``."""
    return {**TORCH, **p.parse_cpuinfo(cpuinfo), "cpu_arch": "x86_64",
            "cache_l2_bytes": 2**20, "cache_l3_bytes": 32 * 2**20, **extra}


OLD_BLOCK = {"platform": "Linux-6.1-x86_64", "processor": "x86_64", "cpu_count": 2,
             "torch_threads": 1, "python": "3.11.7", "torch": "2.13.0+cpu", "cuda": None}


def test_machine_info_names_this_host() -> None:
    info = p.machine_info()
    assert {"platform", "processor", "cpu_count", "torch_threads", "torch"} <= set(info)
    assert isinstance(info["cpu_isa"], list) or info["cpu_isa"] is None
    assert info["cpu_isa"] == sorted(info["cpu_isa"] or [])
    for key in ("cache_l2_bytes", "cache_l3_bytes"):
        assert info[key] is None or (isinstance(info[key], int) and info[key] > 0)
    assert info["onednn"] in (True, False, None)
    assert isinstance(info["torch_cpu_capability"], (str, type(None)))
    assert isinstance(info["torch_blas"], (str, type(None)))
    assert p.host_recorded(info) and p.machine_summary(info)
    cpuinfo = Path("/proc/cpuinfo")
    if platform.system() != "Linux" or not cpuinfo.exists():
        return
    text = cpuinfo.read_text(errors="replace")
    assert info["cpu_model"] and info["cpu_vendor"] or "model name" not in text
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), None)
    if flags is not None:   # x86: the recorded list is what the kernel says, filtered
        assert ("avx2" in info["cpu_isa"]) == ("avx2" in flags)
        assert ("avx512f" in info["cpu_isa"]) == ("avx512f" in flags)


def test_cpuinfo_of_an_avx2_host() -> None:
    host = p.parse_cpuinfo(AVX2_CPUINFO)
    assert host == {"cpu_model": "AMD EPYC 7B13", "cpu_vendor": "AuthenticAMD",
                    "cpu_isa": ["avx2", "fma"]}
    assert p.isa_class(block(AVX2_CPUINFO)) == "AVX2"
    assert p.isa_text(host["cpu_isa"]) == "AVX2 (FMA)"


def test_cpuinfo_of_an_avx512_and_amx_host() -> None:
    host = p.parse_cpuinfo(AMX_CPUINFO)
    assert host["cpu_vendor"] == "GenuineIntel"
    assert host["cpu_isa"] == ["amx_bf16", "amx_int8", "amx_tile", "avx2", "avx512_bf16",
                               "avx512_vnni", "avx512bw", "avx512f", "avx_vnni", "fma"]
    assert p.isa_class(block(AMX_CPUINFO)) == "AMX"
    assert p.isa_text(host["cpu_isa"]) == "AVX-512 (VNNI, BF16) + AMX (BF16, INT8)"


def test_cpuinfo_of_an_arm_host() -> None:
    host = p.parse_cpuinfo(ARM_CPUINFO)
    assert host == {"cpu_model": "Neoverse-V1", "cpu_vendor": "ARM",
                    "cpu_isa": ["bf16", "dotprod", "i8mm", "neon", "sve"]}
    assert p.isa_class(block(ARM_CPUINFO, cpu_arch="aarch64")) == "Arm SVE"
    unknown_part = ARM_CPUINFO.replace("0x41", "0xc0").replace("0xd40", "0x123")
    assert p.parse_cpuinfo(unknown_part)["cpu_model"] == "Ampere part 0x123"
    assert p.parse_cpuinfo("")["cpu_isa"] is None   # nothing said: unknown, not "none"


def test_sysctl_of_two_macs() -> None:
    apple = p.parse_sysctl(APPLE_SYSCTL)
    assert apple == {"cpu_model": "Apple M2 Pro", "cpu_vendor": "Apple",
                     "cpu_isa": ["bf16", "dotprod", "neon"], "cache_l2_bytes": 4194304,
                     "cache_l3_bytes": None}
    intel = p.parse_sysctl(INTEL_MAC_SYSCTL)
    assert intel["cpu_vendor"] == "GenuineIntel" and intel["cpu_isa"] == ["avx2", "fma"]
    assert intel["cache_l3_bytes"] == 16 * 2**20
    assert p.parse_sysctl("")["cpu_isa"] is None


def test_cache_sizes_and_blas_from_their_text() -> None:
    entries = [("1\n", "Data\n", "32K\n"), ("1", "Instruction", "32K"),
               ("2", "Unified", "1024K"), ("3", "Unified", "32768K"), ("3", "Unified", "bad")]
    assert p.parse_cache_sizes(entries) == {"cache_l2_bytes": 2**20, "cache_l3_bytes": 2**25}
    assert p.parse_cache_sizes([]) == {"cache_l2_bytes": None, "cache_l3_bytes": None}
    assert p.blas_of("  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release") == "MKL"
    assert p.blas_of("BLAS_INFO=open, LAPACK_INFO=open") == "OpenBLAS"
    assert p.blas_of("BLAS_INFO=accelerate") == "Accelerate"
    assert p.blas_of("no blas line") is None


def test_hosts_compare_by_isa_class() -> None:
    avx2, amx = block(AVX2_CPUINFO), block(AMX_CPUINFO)
    avx512 = block("vendor_id: AuthenticAMD\nmodel name: AMD EPYC 9B45\n"
                   "flags: avx2 fma avx512f avx512bw\n")
    assert p.isa_class(avx512) == "AVX-512"
    assert p.same_isa_class(avx2, avx2) is True
    assert p.same_isa_class(avx2, avx512) is False and p.same_isa_class(avx512, amx) is False
    assert p.same_isa_class(avx2, OLD_BLOCK) is None and p.same_isa_class(None, avx2) is None
    assert p.host_key(avx2) == "AMD EPYC 7B13, AVX2" and p.host_key(OLD_BLOCK) is None
    # The OS said nothing of the ISA: torch's own dispatch names the class, else "unknown".
    assert p.isa_class({**avx2, "cpu_isa": None}) == "AVX-512"
    assert p.same_isa_class({**avx2, "cpu_isa": None, "torch_cpu_capability": "DEFAULT"},
                            avx2) is None


def test_the_summary_names_the_host_or_says_it_is_not_recorded() -> None:
    summary = p.machine_summary(block(AMX_CPUINFO, cache_l2_bytes=2 * 2**20))
    assert summary == ("Intel(R) Xeon(R) Platinum 8480C (GenuineIntel), AVX-512 (VNNI, BF16) "
                       "+ AMX (BF16, INT8), L2 2 MiB, L3 32 MiB, torch CPU capability AVX512, "
                       "BLAS MKL, oneDNN on, 2 cores, 1 thread, torch 2.13.0")
    assert p.machine_summary(OLD_BLOCK) == ("host not recorded (2 cores, 1 thread, "
                                            "torch 2.13.0+cpu)")
    assert "cores" in p.machine_summary()   # this machine, now


def test_a_chapter_names_both_machines() -> None:
    report = {"suite": "spec", "date": "2026-12-01T07:08:30+00:00", "git_commit": "a" * 40,
              "machine": block(AVX2_CPUINFO), "load": {"before": 0.4, "busy": False}}
    text = course_runs.provenance(report, here=block(AMX_CPUINFO))
    first, theirs, here, warning = text.splitlines()
    assert first.startswith("bench spec, 2026-12-01 07:08 UTC, commit aaaaaaa")
    assert "AMD EPYC 7B13" in theirs and "Xeon" in here
    assert "different ISA classes (AVX2 there, AMX here)" in warning
    old = course_runs.provenance({**report, "machine": OLD_BLOCK}, here=block(AMX_CPUINFO))
    assert "the course's run: host not recorded" in old and "ISA classes" not in old
    assert "this one (" in course_runs.missing("spec")


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/cpuinfo")
def test_this_hosts_lookup_matches_the_parser() -> None:
    host = p.cpu_host()
    assert host["cpu_isa"] == p.parse_cpuinfo(Path("/proc/cpuinfo").read_text())["cpu_isa"]
    host["cpu_isa"] = ["changed"]   # a caller's copy: the cached lookup stays as it was
    assert p.cpu_host()["cpu_isa"] != ["changed"]
