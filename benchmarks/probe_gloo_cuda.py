"""Which torch.distributed collectives gloo runs on CUDA tensors on this machine
(Megatron's plain TP path needs all_gather_into_tensor and reduce_scatter_tensor
when ranks share one GPU over gloo). torchrun --nproc-per-node 2 this_file"""
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
torch.cuda.set_device(0)
r = dist.get_rank()
x = torch.full((4, 2), float(r + 1), device="cuda")
for name, fn in [("all_reduce", lambda: dist.all_reduce(x.clone())),
                 ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(8, 2, device="cuda"), x)),
                 ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(2, 2, device="cuda"), x)),
                 ("all_gather", lambda: dist.all_gather([torch.empty_like(x) for _ in range(2)], x))]:
    try:
        fn()
        ok = "ok"
    except Exception as e:  # noqa: BLE001
        ok = f"FAILS: {str(e).splitlines()[0][:120]}"
    if r == 0:
        print(f"gloo cuda {name}: {ok}", flush=True)
dist.destroy_process_group()
