"""What this machine has: CUDA GPUs, CPU, RAM, measured copy bandwidths and forward-time curves.

The planner (core/planning/) is a pure function of a `HardwareProfile`, so a profile is plain data:
it round-trips through JSON, and a synthetic one (tests, `specchat plan --profile FILE`) plans
exactly like a measured one. Measuring bandwidth takes a second per GPU and a t(n) curve up to a
minute per model, so both are cached on disk under a key of what determines them (GPU names, CUDA
and torch versions, RAM size); `load_or_probe(refresh=True)` measures again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import platform
import re
import statistics
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from .env_settings import env_number
from .files import write_atomically
from .speculative.forward_times import ForwardTimes, disturbed

FORMAT_VERSION = 1  # of the profile and curve files; bump when a field changes meaning
VRAM_LIMIT_ENV = "SPECCHAT_VRAM_LIMIT"  # GB per GPU; `--vram-limit` sets it, so worker processes see it too
BANDWIDTH_BYTES = 256 * 2**20  # one timed copy: large enough that launch overhead is noise
BANDWIDTH_REPEATS = 5


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA device. Bandwidths are None when not measured (a probe without measurement)."""

    index: int
    name: str
    vram_total_bytes: int
    vram_free_bytes: int  # at probe time: other processes (a desktop) may hold the rest
    compute_capability: tuple[int, int]
    bf16: bool  # native bfloat16 (compute capability 8.0 and up)
    host_to_device_bytes_per_s: float | None  # pinned host memory -> this GPU, median copy
    device_to_host_bytes_per_s: float | None
    memory_bytes_per_s: float | None  # on-device copy: bytes read + bytes written per second


@dataclass(frozen=True)
class CpuInfo:
    model: str
    logical_cores: int
    physical_cores: int | None  # psutil cannot always tell


@dataclass(frozen=True)
class ModelCurves:
    """Measured t(n) of one model (weights, revision and dtype in `model_key`) at a few context
    lengths, ascending: attention's share of a forward grows with the context."""

    model_key: str
    times: tuple[ForwardTimes, ...]

    def at(self, context: int) -> ForwardTimes:
        """The curve measured nearest to `context` on a log scale (8K is as near to 4K as 16K)."""
        return min(self.times, key=lambda times: abs(math.log(max(times.context, 1) / max(context, 1))))


@dataclass(frozen=True)
class HardwareProfile:
    gpus: tuple[GpuInfo, ...]  # empty on a CPU-only machine
    cpu: CpuInfo
    ram_total_bytes: int
    ram_available_bytes: int
    torch_version: str
    cuda_version: str | None  # the CUDA runtime torch was built with; None without CUDA
    measured_on: str  # ISO date of the probe
    curves: tuple[ModelCurves, ...] = ()
    # "linux", "windows" or "darwin"; None in profiles saved before the OS was recorded (read as
    # Linux's rules, where every profile so far was probed).
    os: str | None = None

    @property
    def pinnable_bytes(self) -> int:
        """RAM that may be page-locked for an offloaded KV: CUDA on Windows (WDDM) caps it at half the
        RAM; elsewhere only the RAM itself bounds it (the plan's margin applies on top). A rule, not a
        measurement: pinning to find out costs seconds per GB and keeps the memory until exit."""
        return self.ram_total_bytes // 2 if self.os == "windows" else self.ram_total_bytes

    def machine_key(self) -> str:
        """What the cached measurements depend on: GPU names, CUDA and torch versions, RAM size
        (in GB, so a reading that wobbles by a page does not invalidate the cache), CPU model."""
        parts = [str(FORMAT_VERSION), *(gpu.name for gpu in self.gpus), self.cuda_version or "no-cuda",
                 self.torch_version, str(round(self.ram_total_bytes / 1e9)), self.cpu.model]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]

    def curves_for(self, model_key: str) -> ModelCurves | None:
        return next((curves for curves in self.curves if curves.model_key == model_key), None)

    def with_curves(self, new: ModelCurves) -> HardwareProfile:
        """This profile with `new` replacing any curves of the same model."""
        kept = tuple(curves for curves in self.curves if curves.model_key != new.model_key)
        return dataclasses.replace(self, curves=kept + (new,))

    def to_json(self) -> str:
        return json.dumps({"version": FORMAT_VERSION, **dataclasses.asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> HardwareProfile:
        """Parse `to_json`'s output (or a hand-written synthetic profile); ValueError saying what
        is wrong otherwise."""
        try:
            data = json.loads(text)
            if data.pop("version", None) != FORMAT_VERSION:
                raise ValueError(f"format version is not {FORMAT_VERSION}")
            gpus = tuple(GpuInfo(**{**gpu, "compute_capability": tuple(gpu["compute_capability"])})
                         for gpu in data.pop("gpus"))
            cpu = CpuInfo(**data.pop("cpu"))
            curves = tuple(_curves_from_dict(item) for item in data.pop("curves", ()))
            data.pop("cpu_attention_bytes_per_s", None)  # profiles saved before 2026-11-24 measured it; unused
            profile = cls(gpus=gpus, cpu=cpu, curves=curves, **data)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"not a hardware profile: {error}") from None
        _check(profile)
        return profile

    @classmethod
    def load(cls, path: Path) -> HardwareProfile:
        """Read a profile file; ValueError naming the file if it is missing or not a profile."""
        try:
            return cls.from_json(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise ValueError(f"{path}: {error}") from None


# What a profile's sizes and rates may be: beyond these a hand-written profile holds a typo (and
# the plan's arithmetic would overflow or divide by nothing).
MOST_BYTES = 2 ** 60
RATES = (1e6, 1e15)  # bytes per second: a megabyte to a petabyte


def _check(profile: HardwareProfile) -> None:
    sizes = {"ram_total_bytes": profile.ram_total_bytes, "ram_available_bytes": profile.ram_available_bytes,
             **{f"GPU {gpu.index}: {name}": getattr(gpu, name) for gpu in profile.gpus
                for name in ("vram_total_bytes", "vram_free_bytes")}}
    for name, size in sizes.items():
        if not _is_real(size) or not 0 <= size <= MOST_BYTES:
            raise ValueError(f"{name} must be a number of bytes from 0 to 2**60, got {size!r}")
    for gpu in profile.gpus:
        for name in ("host_to_device_bytes_per_s", "device_to_host_bytes_per_s", "memory_bytes_per_s"):
            rate = getattr(gpu, name)
            if rate is not None and not (_is_real(rate) and RATES[0] <= rate <= RATES[1]):
                raise ValueError(f"GPU {gpu.index}: {name} must be bytes per second from 1e6 to 1e15 "
                                 f"(or null: not measured), got {rate!r}")
    if profile.ram_total_bytes <= 0 or not 0 <= profile.ram_available_bytes <= profile.ram_total_bytes:
        raise ValueError("RAM sizes must be positive, available at most total")
    if profile.os not in (None, "linux", "windows", "darwin"):
        raise ValueError(f"os must be linux, windows or darwin, got {profile.os!r}")
    for gpu in profile.gpus:
        if gpu.vram_total_bytes <= 0 or not 0 <= gpu.vram_free_bytes <= gpu.vram_total_bytes:
            raise ValueError(f"GPU {gpu.index}: VRAM sizes must be positive, free at most total")
        rates = (gpu.host_to_device_bytes_per_s, gpu.device_to_host_bytes_per_s, gpu.memory_bytes_per_s)
        if any(rate is not None and not rate > 0 for rate in rates):
            raise ValueError(f"GPU {gpu.index}: bandwidths must be positive (or null: not measured)")


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _curves_from_dict(data: dict) -> ModelCurves:
    times = tuple(ForwardTimes(**{**item, "sizes": tuple(item["sizes"]), "ratios": tuple(map(float, item["ratios"]))})
                  for item in data["times"])
    if not times:
        raise ValueError(f"curves of {data['model_key']} hold no measurement")
    return ModelCurves(data["model_key"], times)


# Bump when the forward's kernels change what t(n) is, so curves measured before are measured
# again (2: cpu_linear.py's single rows and 5-8 rows, 2026-11-23; 3: one-query attention folded on
# the CPU, kv/queries.py, 2026-11-24; 4: the few-row CPU linear path measured per machine,
# linear_choice.py, 2026-11-28; 5: that path timed in whole forwards, which sends 6-8 rows
# weight-first on machines where they went through F.linear, 2026-11-29).
FORWARD_KERNELS = 5


def curve_key(repo: str, revision: str, weights: str, kv: str = "") -> str:
    """The name a model's curves are stored under: t(n) depends on the weights and their format
    (a 4-bit forward dequantizes on the fly), so all three are in it, on how the KV is held
    (`kv_label`; "" for the model's own dtype where it computes) and on the forward's kernels."""
    return f"{repo}@{revision[:12] or 'local'}:{weights}{'+' + kv if kv else ''}#k{FORWARD_KERNELS}"


def kv_label(int8: bool, offloaded: bool, resident_layers: int = 0) -> str:
    """The part of a curve key for a KV that changes t(n): 8-bit codes (dequantized per step)
    and one streamed from CPU memory (a PCIe read per verification), but for the layers that
    keep theirs on the GPU (a partial offload)."""
    streamed = f"kv-offloaded-{resident_layers}-resident" if resident_layers else "kv-offloaded"
    return "+".join(part for part, held in (("kv-int8", int8), (streamed, offloaded)) if held)


# ---- probing -------------------------------------------------------------------------------


def probe(measure_bandwidth: bool = True) -> HardwareProfile:
    """This machine now. CPU-only (or a torch without CUDA): `gpus` is empty."""
    import psutil
    import torch

    memory = psutil.virtual_memory()
    cuda = torch.cuda.is_available()
    gpus = tuple(_probe_gpu(index, measure_bandwidth) for index in range(torch.cuda.device_count())) if cuda else ()
    cpu = CpuInfo(_cpu_model(), psutil.cpu_count(logical=True) or 1, psutil.cpu_count(logical=False))
    return HardwareProfile(gpus=gpus, cpu=cpu, ram_total_bytes=memory.total, ram_available_bytes=memory.available,
                           torch_version=torch.__version__, cuda_version=torch.version.cuda if cuda else None,
                           measured_on=date.today().isoformat(), os=_os_name())


def _os_name() -> str:
    system = platform.system().lower()
    return {"windows": "windows", "darwin": "darwin"}.get(system, "linux")


def _probe_gpu(index: int, measure_bandwidth: bool) -> GpuInfo:
    import torch

    properties = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    rates = measure_copy_bandwidth(index, free) if measure_bandwidth else (None, None, None)
    return GpuInfo(index=index, name=properties.name, vram_total_bytes=total, vram_free_bytes=free,
                   compute_capability=(properties.major, properties.minor), bf16=properties.major >= 8,
                   host_to_device_bytes_per_s=rates[0], device_to_host_bytes_per_s=rates[1],
                   memory_bytes_per_s=rates[2])


def measure_copy_bandwidth(index: int, free_bytes: int) -> tuple[float, float, float]:
    """(host-to-device, device-to-host, on-device) bytes per second on GPU `index`.

    Why pinned memory and events: an offloaded KV streams from pinned host memory with
    `copy_(non_blocking=True)` on a side stream, so that is what is timed, on the GPU's own clock.
    One untimed copy each way first (allocation, driver warm-up), then the median of
    BANDWIDTH_REPEATS. On-device counts the bytes read plus written, as a memory-bound forward does.
    """
    import torch

    size = min(BANDWIDTH_BYTES, free_bytes // 4)  # never crowd out what is already running
    device = torch.device("cuda", index)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(size, dtype=torch.uint8, device=device)
    other = torch.empty(size, dtype=torch.uint8, device=device)

    def seconds(destination: torch.Tensor, source: torch.Tensor) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        destination.copy_(source, non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000

    with torch.cuda.device(device):
        rates = []
        for destination, source, moved in ((on_device, host, size), (host, on_device, size),
                                           (other, on_device, 2 * size)):
            seconds(destination, source)  # warm-up
            rates.append(moved / statistics.median(seconds(destination, source) for _ in range(BANDWIDTH_REPEATS)))
    del host, on_device, other
    torch.cuda.empty_cache()
    return rates[0], rates[1], rates[2]


def _cpu_model() -> str:
    """The CPU's marketing name: /proc/cpuinfo on Linux, else what `platform` knows."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
        if found:
            return found.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


# ---- the cache on disk ---------------------------------------------------------------------


def cache_dir() -> Path:
    from .embedded import cache_root

    return cache_root() / "hardware"


def load_or_probe(refresh: bool = False, root: Path | None = None) -> HardwareProfile:
    """The profile of this machine: measured bandwidths and curves from the cache when this
    machine's key has them (unless `refresh`), else measured now and saved. Free VRAM and
    available RAM change from minute to minute, so they are always read fresh. The GPUs are seen
    through `--vram-limit` (the saved file holds what the cards really have)."""
    current = probe(measure_bandwidth=False)
    folder = (root or cache_dir()) / current.machine_key()
    path = folder / "profile.json"
    saved = None
    if not refresh and path.is_file():
        try:
            saved = HardwareProfile.load(path)
        except ValueError:
            saved = None  # an old or damaged file is measured again, never trusted
    if saved is None:
        saved = probe(measure_bandwidth=True)
        write_atomically(path, dataclasses.replace(saved, curves=()).to_json())
    profile = _with_fresh_free_memory(saved, current)
    for curves_path in sorted((folder / "curves").glob("*.json")):
        try:
            profile = profile.with_curves(read_curves(curves_path))
        except ValueError:
            curves_path.unlink(missing_ok=True)
    return capped(profile, vram_limit_bytes())


def vram_limit_bytes() -> int | None:
    """The cap on what specchat uses of each GPU, from SPECCHAT_VRAM_LIMIT (`--vram-limit`), or
    None. In GB as cards are sold: 8 means an "8 GB" card, 8 GiB."""
    limit = env_number(VRAM_LIMIT_ENV, None, above=0.5,
                       wanted="the GB specchat may use on each GPU (--vram-limit), such as 8 or 11.5")
    return None if limit is None else int(limit * 2**30)


def capped(profile: HardwareProfile, limit_bytes: int | None) -> HardwareProfile:
    """`profile` as if each GPU had at most `limit_bytes` (None: unchanged). Memory that other
    processes hold counts only where it cuts into the limit: free becomes min(free, limit)."""
    if limit_bytes is None:
        return profile
    gpus = tuple(dataclasses.replace(gpu, vram_total_bytes=min(gpu.vram_total_bytes, limit_bytes),
                                     vram_free_bytes=min(gpu.vram_free_bytes, limit_bytes))
                 for gpu in profile.gpus)
    return dataclasses.replace(profile, gpus=gpus)


def cap_cuda_allocator(plan_caps: dict[int, int] | None = None) -> None:
    """Hold torch's CUDA allocator on each GPU to the smaller of the `--vram-limit` and what the
    plan lets it fill (`plan_caps`, GPU index -> bytes), so that going past it raises CUDA out of
    memory as the smaller card would, instead of the driver spilling into system RAM (Windows'
    default) at a fraction of the speed. The CUDA context itself is outside the cap; the plan
    budgets it inside. Nothing without a cap or without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return
    limit = vram_limit_bytes()
    for index in range(torch.cuda.device_count()):
        caps = [cap for cap in (limit, (plan_caps or {}).get(index)) if cap is not None]
        if caps:
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, min(caps) / total), index)


def probe_key() -> str:
    """This machine's key from a probe without measurement (cheap)."""
    return probe(measure_bandwidth=False).machine_key()


def _with_fresh_free_memory(saved: HardwareProfile, current: HardwareProfile) -> HardwareProfile:
    gpus = tuple(dataclasses.replace(gpu, vram_free_bytes=now.vram_free_bytes)
                 for gpu, now in zip(saved.gpus, current.gpus))
    # The OS too: a profile saved before it was recorded would otherwise read as Linux's rules.
    return dataclasses.replace(saved, gpus=gpus, ram_available_bytes=current.ram_available_bytes, os=current.os)


def curves_path(folder: Path, model_key: str) -> Path:
    """Where the curves of `model_key` on the machine of `folder` are kept."""
    return folder / "curves" / (hashlib.sha256(model_key.encode()).hexdigest()[:16] + ".json")


def read_curves(path: Path) -> ModelCurves:
    try:
        data = json.loads(path.read_text())
        if data.pop("version") != FORMAT_VERSION:
            raise ValueError(f"format version is not {FORMAT_VERSION}")
        curves = _curves_from_dict(data)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a curves file: {error}") from None
    reasons = disturbed(curves.times)  # saved before calibration checked for a busy machine
    if reasons:
        raise ValueError(f"{path} was measured on a busy machine: {'; '.join(reasons.values())}")
    return curves
