"""The accelerator table: memory, bandwidth, dense peak TFLOP/s per GEMM format, interconnect.

Figures are the vendors' published dense (no 2:4 sparsity) peaks per accelerator; each row names
the document it comes from, and its note says where a figure is uncertain or derived (for example
a per-GPU figure divided out of a per-system one). Memory is the vendor's quoted capacity in GB.

[Note: hardware peaks and lowprec's GEMMs]
A row lists the peaks of the GEMM formats the hardware has; ``fp32`` is its plain (non-tensor-core) FP32
rate, which an emulated GEMM runs at where its values are not exact in BF16 or the device is not CUDA
(``lowprec.kernels.gemm.emulation_dtype``; a row that lists none is timed at its BF16 peak). Which of
the hardware's formats lowprec runs natively is not the table's to say: the row's :attr:`GPU.capability`
is the one ``gemm_path`` would be given on that device, and the planner asks
``lowprec.kernels.native.is_native`` (``gemm_path``) for each GEMM of a recipe. Its ``triton`` is False:
the planner counts a cast's memory traffic, whichever backend (Triton or the reference) would run it. A
GEMM the kernels emulate is planned as a high-precision GEMM plus its casts' memory traffic, whatever
peak the hardware lists for its format: NVFP4 on a B200 is planned at the B200's BF16 speed until
lowprec has a native NVFP4 GEMM.
"""
from __future__ import annotations

from dataclasses import dataclass

from lowprec._checks import check_choice, fail
from lowprec.kernels.capability import Capability, cuda_capability, host_capability

GEMM_FORMATS = ("bf16", "fp16", "fp32", "fp8", "mxfp8", "mxfp6", "mxfp4", "nvfp4")
"""GEMM formats a peak can be given for; ``fp8`` covers E4M3/E5M2 with per-tensor, row or block scales."""

EMULATION_FORMAT = "bf16"
"""The peak every row must list: high-precision GEMMs, and emulated ones exact in BF16, run at it."""


def arch_of_sm(sm: tuple[int, int]) -> str:
    """The table's name of a CUDA compute capability: ``sm90`` for ``(9, 0)``, ``sm103`` for ``(10, 3)``."""
    return f"sm{sm[0]}{sm[1]}"


def sm_of_arch(arch: str) -> tuple[int, int] | None:
    """The compute capability an ``sm`` arch names (the minor version is its last digit); None for
    another vendor's architecture."""
    digits = arch[2:]
    if not arch.startswith("sm") or len(digits) < 2 or not digits.isdigit():
        return None
    return int(digits[:-1]), int(digits[-1])


def rocm_sm(arch: str) -> tuple[int, int] | None:
    """The ``(major, minor)`` torch reports through ``torch.cuda`` for an AMD ``gfx`` architecture under
    ROCm (``gfx942`` -> (9, 4): the last digit is the stepping), which the kernels decide by; None for
    another name."""
    digits = arch[3:]
    if not arch.startswith("gfx") or len(digits) < 3 or not digits[:-2].isdigit():
        return None
    return int(digits[:-2]), int(digits[-2], 16)


@dataclass(frozen=True, kw_only=True, slots=True)
class GPU:
    key: str
    """Name on the command line."""
    name: str
    vendor: str
    arch: str
    """``sm90`` for a CUDA compute capability 9.0; ``gfx942`` for AMD; ``gaudi3``."""
    memory_gb: float
    hbm_tb_s: float
    link_gb_s: float
    """Scale-up interconnect per accelerator, both directions together."""
    link: str
    peaks: tuple[tuple[str, float], ...]
    """``(GEMM format, dense peak TFLOP/s)`` for each format the hardware has (see [Note: hardware peaks
    and lowprec's GEMMs])."""
    source: str
    note: str = ""

    def __post_init__(self) -> None:
        for fmt, tflops in self.peaks:
            check_choice(f"{self.key}.peaks", fmt, GEMM_FORMATS)
            if tflops <= 0:
                fail(f"{self.key}.peaks[{fmt}]", "a positive TFLOP/s", tflops)
        if EMULATION_FORMAT not in dict(self.peaks):
            fail(f"{self.key}.peaks", f"a {EMULATION_FORMAT} peak (high-precision GEMMs run at it)", self.peaks)

    @property
    def capability(self) -> Capability:
        """What ``gemm_path`` would be given on this accelerator: a CUDA compute capability, or the one
        ROCm reports for an AMD architecture; any other (Gaudi) a host's, on which every low-precision
        GEMM is emulated, in FP32."""
        sm = sm_of_arch(self.arch) or rocm_sm(self.arch)
        if sm is not None:
            return cuda_capability(sm, name=self.name)
        return host_capability("hpu", self.name)  # Intel Gaudi: torch's "hpu" devices

    def peak(self, fmt: str) -> tuple[float, bool]:
        """``(dense peak TFLOP/s, listed)`` of a GEMM in ``fmt``: the row's figure, or the BF16 peak
        and False where the row lists none."""
        check_choice("gemm format", fmt, GEMM_FORMATS)
        peaks = dict(self.peaks)
        if fmt in peaks:
            return peaks[fmt], True
        return peaks[EMULATION_FORMAT], False


def _peaks(bf16: float, fp8: float | None = None, fp6: float | None = None, fp4: float | None = None,
           nvfp4: bool = False, fp16: bool = True, fp32: float | None = None) -> tuple[tuple[str, float], ...]:
    """Peaks for the usual pattern: FP16 at the BF16 rate, MXFP8 at the FP8 rate, NVFP4 at the FP4 rate."""
    out = [("bf16", bf16)] + ([("fp16", bf16)] if fp16 else []) + ([("fp32", fp32)] if fp32 else [])
    if fp8:
        out.append(("fp8", fp8))
    if fp6:  # block-scaled MX GEMMs come with FP6/FP4 support
        out += [("mxfp8", fp8), ("mxfp6", fp6), ("mxfp4", fp4)]
    if nvfp4:
        out.append(("nvfp4", fp4))
    return tuple(out)


_NV_BLACKWELL = "NVLink 5"

GPUS: dict[str, GPU] = {g.key: g for g in (
    GPU(key="a100", name="NVIDIA A100 SXM4 80GB", vendor="NVIDIA", arch="sm80", memory_gb=80, hbm_tb_s=2.039,
        link_gb_s=600, link="NVLink 3", peaks=_peaks(312, fp32=19.5),
        source="NVIDIA A100 Tensor Core GPU datasheet"),
    GPU(key="h100", name="NVIDIA H100 SXM5", vendor="NVIDIA", arch="sm90", memory_gb=80, hbm_tb_s=3.35,
        link_gb_s=900, link="NVLink 4", peaks=_peaks(989, fp8=1979, fp32=67),
        source="NVIDIA H100 Tensor Core GPU datasheet",
        note="the datasheet's 1,979 / 3,958 TFLOPS are with sparsity; dense is half"),
    GPU(key="h200", name="NVIDIA H200 SXM", vendor="NVIDIA", arch="sm90", memory_gb=141, hbm_tb_s=4.8,
        link_gb_s=900, link="NVLink 4", peaks=_peaks(989, fp8=1979, fp32=67),
        source="NVIDIA H200 Tensor Core GPU datasheet",
        note="same compute as H100 SXM; sparse figures halved"),
    GPU(key="b200", name="NVIDIA B200 (HGX, 1000 W)", vendor="NVIDIA", arch="sm100", memory_gb=180,
        hbm_tb_s=7.7, link_gb_s=1800, link=_NV_BLACKWELL,
        peaks=_peaks(2250, fp8=4500, fp6=4500, fp4=9000, nvfp4=True, fp32=80),
        source="NVIDIA HGX B200 / DGX B200 specifications",
        note="per-GPU figures from the 8-GPU HGX totals, sparse figures halved; early material quotes "
             "192 GB and 8 TB/s"),
    GPU(key="gb200", name="NVIDIA Blackwell GPU in GB200 NVL72 (1200 W)", vendor="NVIDIA", arch="sm100",
        memory_gb=186, hbm_tb_s=8.0, link_gb_s=1800, link=_NV_BLACKWELL,
        peaks=_peaks(2500, fp8=5000, fp6=5000, fp4=10000, nvfp4=True, fp32=90),
        source="NVIDIA GB200 NVL72 specifications",
        note="per GPU: the rack totals over 72 GPUs, sparse figures halved"),
    GPU(key="b300", name="NVIDIA B300 Blackwell Ultra (HGX)", vendor="NVIDIA", arch="sm103", memory_gb=288,
        hbm_tb_s=8.0, link_gb_s=1800, link=_NV_BLACKWELL,
        peaks=_peaks(2250, fp8=4500, fp6=4500, fp4=13000, nvfp4=True),
        source="NVIDIA HGX B300 specifications",
        note="uncertain: per-GPU figures divided out of HGX totals; dense FP4 given as 105 PFLOPS per "
             "8 GPUs (about 13 PF); GB300 NVL72 parts are rated higher (about 15 PF FP4); no FP32 rate "
             "is listed"),
    GPU(key="mi300x", name="AMD Instinct MI300X", vendor="AMD", arch="gfx942", memory_gb=192, hbm_tb_s=5.3,
        link_gb_s=896, link="Infinity Fabric (7 links)", peaks=_peaks(1307.4, fp8=2614.9, fp32=163.4),
        source="AMD Instinct MI300X data sheet",
        note="FP8 is the FNUZ variant (no negative zero, bias one higher), not OCP E4M3/E5M2"),
    GPU(key="mi325x", name="AMD Instinct MI325X", vendor="AMD", arch="gfx942", memory_gb=256, hbm_tb_s=6.0,
        link_gb_s=896, link="Infinity Fabric (7 links)", peaks=_peaks(1307.4, fp8=2614.9, fp32=163.4),
        source="AMD Instinct MI325X data sheet",
        note="same compute as MI300X; FP8 is the FNUZ variant"),
    GPU(key="mi355x", name="AMD Instinct MI355X", vendor="AMD", arch="gfx950", memory_gb=288, hbm_tb_s=8.0,
        link_gb_s=1075, link="Infinity Fabric (7 links)",
        peaks=_peaks(2516.6, fp8=5033.2, fp6=10066.3, fp4=10066.3, fp32=157.3),
        source="AMD Instinct MI355X data sheet",
        note="OCP FP8 and MX formats; FP6 runs at the FP4 rate; NVFP4 (E4M3 scales per 16) is not "
             "listed; link figure uncertain"),
    GPU(key="gaudi3", name="Intel Gaudi 3 (OAM)", vendor="Intel", arch="gaudi3", memory_gb=128,
        hbm_tb_s=3.67, link_gb_s=1200, link="24 x 200 GbE RoCE", peaks=_peaks(1835, fp8=1835, fp16=False),
        source="Intel Gaudi 3 AI Accelerator white paper",
        note="matrix-engine peaks (FP8 at the BF16 rate); an FP16 matrix rate is not listed, so FP16 is "
             "planned at the BF16 figure; no FP32 rate is listed"),
)}


def get_gpu(gpu: str | GPU) -> GPU:
    if isinstance(gpu, GPU):
        return gpu
    if not isinstance(gpu, str):
        fail("gpu", "an accelerator name or a GPU", repr(gpu), TypeError)
    if gpu.lower() not in GPUS:
        fail("gpu", "one of " + ", ".join(GPUS), repr(gpu))
    return GPUS[gpu.lower()]
