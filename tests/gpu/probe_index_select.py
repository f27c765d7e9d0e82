"""GPU probe (run by hand): index_select along dim 1 of permuted cache views, as the flex backend does."""

from __future__ import annotations

import torch


def main() -> None:
    dev = torch.device("cuda")
    k = torch.randn(100, 16, 8, 64, device=dev, dtype=torch.bfloat16)
    idx = torch.randint(0, 100, (37,), device=dev)
    a = torch.index_select(k.permute(2, 0, 1, 3), 1, idx)
    torch.cuda.synchronize()
    want = k.cpu().permute(2, 0, 1, 3).index_select(1, idx.cpu())
    print("blocks via permuted index_select:", float((a.cpu() - want).abs().max()))
    flat = k.view(-1, 8, 64).transpose(0, 1)
    slots = torch.randint(0, 1600, (300,), device=dev)
    c = torch.index_select(flat, 1, slots)
    torch.cuda.synchronize()
    want = flat.cpu().index_select(1, slots.cpu())
    print("slots via transposed index_select:", float((c.cpu() - want).abs().max()))


if __name__ == "__main__":
    main()
