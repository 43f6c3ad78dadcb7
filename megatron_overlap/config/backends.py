"""The backend registry: every transport of `comm`, what it honours and where it
runs. Every other list of backend names (config validation, comm's resolver, the
cost model, the A/B tool, the CLIs) derives from REGISTRY. Pure data: no torch.

Add a backend here (and its module in `comm`); edit its `BackendCaps` when it learns
a knob (config.effects reads them for the settings table).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendCaps:
    """The ub_cfgs knobs one transport honours. No backend runs communication in SM
    kernels of its own (num_sm / cga_size as a grid), moves ring chunks on copy
    engines by `use_ce`, has an FP8 buffer or an atomic GEMM: those keys have no
    effect anywhere, and config.effects says so without a capability for them."""

    sm_margin: bool  # the GEMM can be held num_sm SMs short (set_sm_margin)
    comm_stream: bool  # communication runs on a stream we create (comm_priority)
    why_no_sm: str  # why num_sm / cga_size launch nothing here
    why_no_clusters: str
    why_no_ce: str
    why_no_comm_stream: str = ""
    # why one GEMM holding every SM but one while it waits for the transfers
    # (overlap.wait_gemm, the wait_gemm key) could starve them ("": it runs)
    why_no_wait: str = ""


@dataclass(frozen=True)
class Backend:
    name: str
    caps: BackendCaps
    needs_cuda: str = ""  # why CUDA tensors are needed ("" where CPU works)
    shared_gpu: str = ""  # why ranks sharing one GPU cannot use it ("" where they can)
    inter_node: bool = False  # can carry a per-peer transport's inter-node peers


_NCCL_SMS = "NCCL picks its own SMs"
_TORCH_GRID = "its reductions are torch elementwise kernels, whose grid torch picks"
_NO_CLUSTERS = "its kernels launch without thread-block clusters"
_CUDA = "needs CUDA tensors"

REGISTRY: dict[str, Backend] = {b.name: b for b in (
    Backend("torch_p2p", BackendCaps(
        sm_margin=False, comm_stream=False, why_no_sm=_NCCL_SMS,
        why_no_clusters=_NCCL_SMS + " and launch shape", why_no_ce="NCCL picks its own transport",
        why_no_comm_stream="NCCL runs on ProcessGroupNCCL's internal streams",
        why_no_wait="NCCL's send/recv kernels need SMs, block for block with the peer's, "
                    "which a GEMM holding every SM but one could starve (a deadlock)"),
        shared_gpu="ranks share a GPU: NCCL refuses it (gloo has no CUDA send/recv)",
        inter_node=True),
    Backend("symm", BackendCaps(
        sm_margin=True, comm_stream=True, why_no_sm=_TORCH_GRID, why_no_clusters=_NO_CLUSTERS,
        why_no_ce="ring_exchange chunks always move on copy engines (peer memcpy)"),
        needs_cuda=_CUDA),
    Backend("nvshmem", BackendCaps(
        sm_margin=True, comm_stream=True, why_no_sm=_TORCH_GRID, why_no_clusters=_NO_CLUSTERS,
        why_no_ce="host-initiated puts: NVSHMEM moves chunks on copy engines (P2P) "
                  "or through its proxy and the NIC (remote)",
        why_no_wait="its signal waits beside a GEMM that holds the SMs are not verified "
                    "(that needs one GPU per rank)"),
        needs_cuda=_CUDA,
        shared_gpu="ranks share a GPU: NVSHMEM refuses several processes per GPU",
        inter_node=True),
)}

BACKENDS: tuple[str, ...] = tuple(REGISTRY)  # one transport each (nvshmem needs nvshmem4py)
COMPOSITE: tuple[str, ...] = ("hierarchical",)  # per-peer: a TP group spanning nodes / domains
INTER_BACKENDS: tuple[str, ...] = tuple(n for n, b in REGISTRY.items() if b.inter_node)
AUTO = "auto"
CHOICES: tuple[str, ...] = (AUTO,) + BACKENDS + COMPOSITE  # what install(backend=...) takes
