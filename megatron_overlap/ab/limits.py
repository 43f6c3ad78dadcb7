"""What an A/B run can and cannot show on the machine it ran on, said in its report:
a CPU or shared-GPU run shows that the overlap trains like Megatron's path, not how
fast it is; where the GPU figures and a prediction for the user's own model are."""

from __future__ import annotations

from .launch import Layout

RESULTS = "docs/results.md"  # in the source tree: the measured GPU figures, by topic
SIMULATE = "megatron-overlap simulate --shapes 8b --tp 8"

_WHY_NOT = {
    "cpu": ("On CPU the GEMMs and gloo's transfers run on the same cores, so hiding one "
            "under the other gains nothing, while the overlap's chunks add calls: B's step "
            "time against A's is not a GPU figure, whichever way it goes."),
    "shared_gpu": ("The ranks time-slice one GPU and A's collectives go through gloo (host "
                   "copies): each overlapped handshake waits for the other rank's time slice. "
                   "B's step time against A's says nothing about several GPUs."),
}


def what_it_shows(layout: Layout) -> dict[str, list[str]]:
    """Report sections (heading -> bullet lines) for a run on `layout`."""
    shown = ["B trains like A: the loss difference above, from the same weights, seed and "
             "batches, with every TP linear's passes run by the overlap's schedules (the same "
             "code on every backend) at the settings in `settings.txt`."]
    if layout.functional_only:
        shown.append(f"Not its speed. {_WHY_NOT[layout.mode]}")
    else:
        shown.append("Step times of this model at this size, one rank per GPU over NCCL: a "
                     "small model's layers may be too short for the overlap to pay.")
    where = [f"Measured GPU figures (host time per call, the schedules' GEMM side, a whole "
             f"layer, Megatron-LM training): `{RESULTS}` in the source tree.",
             f"Your own model: `{SIMULATE}` (a Llama preset; or `--shapes NAME_fc1=MxKxN,...` "
             f"with your linears' tokens and per-rank sizes) predicts each pass's time with and "
             f"without the overlap on modelled H200s and links; `megatron-overlap tune` picks "
             f"the settings."]
    return {"What this run can show": shown, "Where the speed is": where}
