"""Where a figure came from: the machine and the git commit, recorded with every report
(training, benchmark suites, the grading benchmark) so a number can be traced back.

The machine block names the CPU (model, vendor), the ISA features that pick torch's kernels
(AVX2, AVX-512, AMX; NEON, SVE), the L2 and L3 sizes, and torch's CPU capability, BLAS and
oneDNN: two VMs that both say "x86_64" can run different kernels (issue 50). A report
written before these keys existed reads as "host not recorded", never as a guess.
``python -m tinyserve.provenance`` prints this machine's one-line summary.
"""
from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from .paths import CHECKOUT

#: The x86 features (as /proc/cpuinfo's ``flags`` name them) that decide which kernels run.
X86_FEATURES = ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni",
                "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
#: Arm's, from /proc/cpuinfo's ``Features`` (asimd is NEON; asimddp the int8 dot product).
ARM_FEATURES = {"asimd": "neon", "asimddp": "dotprod", "sve": "sve", "sve2": "sve2",
                "i8mm": "i8mm", "bf16": "bf16", "sme": "sme"}
#: macOS's ``hw.optional`` names for the same features.
SYSCTL_FEATURES = {"avx2_0": "avx2", "fma": "fma", "avx512f": "avx512f",
                   "avx512bw": "avx512bw", "avx512vnni": "avx512_vnni", "neon": "neon",
                   "AdvSIMD": "neon", "arm.FEAT_DotProd": "dotprod", "arm.FEAT_I8MM": "i8mm",
                   "arm.FEAT_BF16": "bf16", "arm.FEAT_SME": "sme"}
#: Arm's ``CPU implementer`` codes, and the parts of the common server cores (Arm Linux
#: writes no model name).
ARM_VENDORS = {0x41: "ARM", 0x42: "Broadcom", 0x43: "Cavium", 0x48: "HiSilicon",
               0x4E: "NVIDIA", 0x51: "Qualcomm", 0x61: "Apple", 0xC0: "Ampere"}
ARM_PARTS = {(0x41, 0xD0C): "Neoverse-N1", (0x41, 0xD40): "Neoverse-V1",
             (0x41, 0xD49): "Neoverse-N2", (0x41, 0xD4F): "Neoverse-V2",
             (0x41, 0xD84): "Neoverse-V3", (0x41, 0xD8E): "Neoverse-N3",
             (0xC0, 0xAC3): "AmpereOne"}
NOT_RECORDED = "not recorded"


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:  # the oracle the hf suite compares against, when installed (its metadata: an
        # import takes seconds, and a chapter reads this beside every course run it cites)
        info["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pass
    return {**info, **cpu_host(), **torch_cpu()}


# ---- pure parsers: the text an OS gives, to the host's fields ----------------------------

def parse_cpuinfo(text: str) -> dict[str, Any]:
    """Model, vendor and kernel-deciding ISA features from Linux's /proc/cpuinfo (x86 or
    Arm); the first processor's entry speaks for all (they are alike on the hosts we run)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    if "flags" in fields:
        flags = set(fields["flags"].split())
        isa: list[str] | None = sorted(f for f in X86_FEATURES if f in flags)
    elif "features" in fields:
        isa = sorted({name for flag, name in ARM_FEATURES.items()
                      if flag in fields["features"].split()})
    else:
        isa = None
    model, vendor = fields.get("model name"), fields.get("vendor_id")
    if "cpu implementer" in fields:   # Arm: vendor and core from their codes
        implementer = _hex(fields["cpu implementer"])
        part = _hex(fields.get("cpu part", ""))
        vendor = vendor or ARM_VENDORS.get(implementer, fields["cpu implementer"])
        model = model or ARM_PARTS.get((implementer, part),
                                       f"{vendor} part {fields.get('cpu part', '?')}")
    return {"cpu_model": model or None, "cpu_vendor": vendor or None, "cpu_isa": isa}


def parse_cache_sizes(entries: Iterable[tuple[str, str, str]]) -> dict[str, int | None]:
    """L2 and L3 in bytes from (level, type, size) triples as sysfs writes them
    (``("3", "Unified", "32768K")``); instruction caches do not count."""
    sizes: dict[str, int | None] = {"cache_l2_bytes": None, "cache_l3_bytes": None}
    for level, kind, size in entries:
        key = f"cache_l{level.strip()}_bytes"
        if key in sizes and kind.strip() != "Instruction":
            try:
                sizes[key] = max(sizes[key] or 0, _bytes(size.strip()))
            except ValueError:
                continue
    return sizes


def parse_sysctl(text: str) -> dict[str, Any]:
    """The same fields from macOS's ``sysctl`` lines (``name: value``): brand string,
    vendor (Apple Silicon has none; its brand says Apple), ``hw.optional`` flags, caches."""
    values = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
    model = values.get("machdep.cpu.brand_string", "").strip() or None
    vendor = values.get("machdep.cpu.vendor", "").strip() or (
        "Apple" if model and model.startswith("Apple") else None)
    isa = sorted({name for key, name in SYSCTL_FEATURES.items()
                  if values.get(f"hw.optional.{key}", "").strip() == "1"})
    caches = {f"cache_l{n}_bytes": int(values[f"hw.l{n}cachesize"])
              if values.get(f"hw.l{n}cachesize", "").strip().isdigit() else None for n in (2, 3)}
    return {"cpu_model": model, "cpu_vendor": vendor,
            "cpu_isa": isa if any(k.startswith("hw.optional.") for k in values) else None,
            **caches}


def blas_of(config: str) -> str | None:
    """The BLAS torch was built with, from ``torch.__config__.show()``'s ``BLAS_INFO=``."""
    found = re.search(r"BLAS_INFO=([\w.+-]+)", config)
    if not found:
        return None
    names = {"mkl": "MKL", "open": "OpenBLAS", "openblas": "OpenBLAS", "accelerate": "Accelerate",
             "veclib": "Accelerate", "eigen": "Eigen", "blis": "BLIS", "flexi": "FlexiBLAS",
             "nvpl": "NVPL", "armpl": "Arm PL"}
    return names.get(found.group(1).lower(), found.group(1))


def _hex(text: str) -> int | None:
    try:
        return int(text, 16)
    except ValueError:
        return None


def _bytes(size: str) -> int:
    """``'32768K'`` -> bytes (sysfs writes K, sometimes M)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    if size and size[-1].upper() in units:
        return int(size[:-1]) * units[size[-1].upper()]
    return int(size)


# ---- lookups on this machine: each one failure-safe ---------------------------------------

_EMPTY_HOST: dict[str, Any] = {"cpu_model": None, "cpu_vendor": None, "cpu_isa": None,
                               "cache_l2_bytes": None, "cache_l3_bytes": None}


@functools.cache
def _cpu_host() -> dict[str, Any]:
    system = platform.system()
    try:
        found = (_linux_host() if system == "Linux" else _mac_host() if system == "Darwin"
                 else _windows_host() if system == "Windows" else {})
    except Exception:   # a lookup must never cost a report; an unknown host says so instead
        found = {}
    host = {**_EMPTY_HOST, **{k: v for k, v in found.items() if v is not None}}
    return {**host, "cpu_arch": platform.machine() or None}


def cpu_host() -> dict[str, Any]:
    """Model, vendor, architecture, ISA features and L2/L3 of this machine (None where the
    OS would not say); looked up once per process, since none of it changes."""
    host = _cpu_host()
    return {**host, "cpu_isa": None if host["cpu_isa"] is None else list(host["cpu_isa"])}


def _linux_host() -> dict[str, Any]:
    host = parse_cpuinfo(Path("/proc/cpuinfo").read_text(errors="replace"))
    entries = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            entries.append(tuple((index / f).read_text() for f in ("level", "type", "size")))
        except OSError:
            continue
    return {**host, **parse_cache_sizes(entries)}   # type: ignore[arg-type]


def _mac_host() -> dict[str, Any]:
    names = ["machdep.cpu.brand_string", "machdep.cpu.vendor", "hw.l2cachesize",
             "hw.l3cachesize", "hw.optional"]
    out = subprocess.run(["sysctl", *names], capture_output=True, text=True, timeout=5)
    return parse_sysctl(out.stdout)   # an unknown name fails alone: the rest still print


def _windows_host() -> dict[str, Any]:
    import ctypes
    import winreg  # type: ignore[import-not-found]
    key = r"HARDWARE\DESCRIPTION\System\CentralProcessor\0"
    with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, key) as k:
        model = str(winreg.QueryValueEx(k, "ProcessorNameString")[0]).strip()
        vendor = str(winreg.QueryValueEx(k, "VendorIdentifier")[0]).strip()
    # IsProcessorFeaturePresent's PF_* codes: the only ones Windows answers (no FMA, no AMX).
    codes = {19: "neon", 40: "avx2", 41: "avx512f", 43: "dotprod", 46: "sve", 47: "sve2"}
    present = ctypes.windll.kernel32.IsProcessorFeaturePresent  # type: ignore[attr-defined]
    return {"cpu_model": model, "cpu_vendor": vendor,
            "cpu_isa": sorted(name for code, name in codes.items() if present(code))}


def torch_cpu() -> dict[str, Any]:
    """Torch's own view: the CPU kernels it dispatches to, its BLAS, and oneDNN."""
    found: dict[str, Any] = {"torch_cpu_capability": None, "torch_blas": None, "onednn": None}
    try:
        found["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:
        pass
    try:
        found["torch_blas"] = blas_of(torch.__config__.show()) or (
            "MKL" if torch.backends.mkl.is_available() else None)
        found["onednn"] = bool(torch.backends.mkldnn.is_available())
    except Exception:
        pass
    return found


# ---- reading a machine block: one line, a host key, the ISA class --------------------------

def host_recorded(info: dict[str, Any] | None) -> bool:
    """Whether a machine block names its host (reports from before issue 50 do not)."""
    return isinstance(info, dict) and "cpu_isa" in info


def isa_class(info: dict[str, Any] | None) -> str | None:
    """The family of kernels the host runs: ``AMX``, ``AVX-512``, ``AVX2``, ``Arm SVE``,
    ``Arm NEON`` (or ``x86 without AVX2``, ``unknown``); None when the host is not recorded."""
    if not host_recorded(info):
        return None
    assert info is not None
    isa = info.get("cpu_isa")
    if isa is None:   # the OS would not say: torch's own dispatch is the next best witness
        capability = str(info.get("torch_cpu_capability") or "")
        return {"AVX512": "AVX-512", "AVX2": "AVX2"}.get(capability, "unknown")
    features = set(isa)
    for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"),
                       ("sve", "Arm SVE"), ("neon", "Arm NEON")):
        if flag in features:
            return name
    arch = str(info.get("cpu_arch") or "").lower()
    return "x86 without AVX2" if arch in ("x86_64", "amd64", "i686") else "unknown"


def same_isa_class(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool | None:
    """Whether two machine blocks run the same family of kernels; None when either host is
    not recorded or unknown (then nobody can tell, and a caller says so)."""
    classes = isa_class(a), isa_class(b)
    if None in classes or "unknown" in classes:
        return None
    return classes[0] == classes[1]


def host_key(info: dict[str, Any] | None) -> str | None:
    """What two runs must share to be compared as one host's: CPU model and ISA class
    (``"<CPU model>, <ISA class>"``); None when not recorded."""
    if not host_recorded(info):
        return None
    assert info is not None
    return f"{info.get('cpu_model') or 'unknown CPU'}, {isa_class(info)}"


def isa_text(features: Iterable[str]) -> str:
    """The ISA features as a reader wants them: ``"AVX-512 (VNNI, BF16) + AMX (BF16, INT8)"``."""
    f = set(features)

    def with_extras(name: str, extras: tuple[tuple[str, str], ...]) -> str:
        found = [label for flag, label in extras if flag in f]
        return f"{name} ({', '.join(found)})" if found else name

    parts = []
    if "avx512f" in f:
        parts.append(with_extras("AVX-512", (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"))))
    elif "avx2" in f:
        parts.append(with_extras("AVX2", (("fma", "FMA"), ("avx_vnni", "VNNI"))))
    if "amx_tile" in f:
        parts.append(with_extras("AMX", (("amx_bf16", "BF16"), ("amx_int8", "INT8"))))
    if f & {"neon", "sve", "sve2"}:
        base = "Arm SVE2" if "sve2" in f else "Arm SVE" if "sve" in f else "Arm NEON"
        parts.append(with_extras(base, (("dotprod", "dotprod"), ("i8mm", "I8MM"),
                                        ("bf16", "BF16"), ("sme", "SME"))))
    return " + ".join(parts) or "no AVX2/AVX-512/NEON"


def machine_summary(info: dict[str, Any] | None = None) -> str:
    """One line naming the machine a block describes (default: this one, now): CPU model and
    vendor, ISA features (:func:`isa_text`), L2 and L3, torch's CPU capability, BLAS, oneDNN,
    cores, threads, torch (and a GPU where there is one)."""
    info = machine_info() if info is None else info
    threads = info.get("torch_threads")
    tail = [f"{info['cpu_count']} cores" if info.get("cpu_count") else "",
            f"{threads} thread{'s' * (threads != 1)}" if threads else "",
            f"torch {info['torch']}" if info.get("torch") else "",
            f"GPU {info['cuda']}" if info.get("cuda") else ""]
    if not host_recorded(info):
        known = ", ".join(t for t in tail if t)
        return f"host {NOT_RECORDED}" + (f" ({known})" if known else "")
    vendor = info.get("cpu_vendor")
    isa = info.get("cpu_isa")
    onednn = info.get("onednn")
    head = [f"{info.get('cpu_model') or 'unknown CPU'}" + (f" ({vendor})" if vendor else ""),
            isa_text(isa) if isa is not None else f"ISA {isa_class(info)}",
            *(f"L{n} {_size(info[f'cache_l{n}_bytes'])}" for n in (2, 3)
              if info.get(f"cache_l{n}_bytes")),
            f"torch CPU capability {info.get('torch_cpu_capability') or 'unknown'}",
            f"BLAS {info.get('torch_blas') or 'unknown'}",
            "oneDNN " + ("unknown" if onednn is None else "on" if onednn else "off")]
    return ", ".join(t for t in head + tail if t)


def _size(n: int) -> str:
    """Bytes as a cache size reads: ``1 MiB``, ``1.25 MiB``, ``48 KiB``."""
    if n >= 2**20:
        return f"{n / 2**20:g} MiB"
    return f"{n / 2**10:g} KiB"


def git_commit(cwd: Path | None = CHECKOUT) -> str | None:
    """HEAD of the repository, with ``-dirty`` when tracked files differ from it; None outside
    a git checkout (an installed package has none: never report an enclosing repository's).

    Reports under bench/results/ do not count: ``make bench`` writes them one suite after
    another, and the code every later suite runs is still exactly HEAD's."""
    if cwd is None:
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":(exclude)bench/results"],
                               cwd=cwd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


if __name__ == "__main__":
    print(machine_summary())
