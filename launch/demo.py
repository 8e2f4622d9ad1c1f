"""Single-process demo: train a small GPT-style stack with torch_remat and compare
memory and gradients against no checkpointing.

    python launch/demo.py [--steps 30] [--layers 4] [--dim 64] [--seq-len 64]

Data is a character-level snapshot of this repository's documentation, so the
loss visibly falls. Memory is what the forward saves for backward, by the library's
own count (``remat.saved_tensors_report``).
"""

from __future__ import annotations

import argparse
import math
import pathlib

import torch
import torch.nn.functional as F
from torch import nn

import torch_remat as remat

ROOT = pathlib.Path(__file__).resolve().parent.parent


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float, save_matmuls: bool):
        super().__init__()
        self.heads, self.dropout, self.save = heads, dropout, save_matmuls
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def attention_core(self, qkv):
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        att = F.dropout(att.softmax(-1), self.dropout, self.training)
        return (att @ v).transpose(1, 2).reshape(b, s, -1)

    def linear(self, layer, name, x):
        # Megatron-style selective recompute: keep the matmuls, replay the rest.
        out = remat.region(layer, name, recompute=not self.save)(x)
        remat.recompute_needs_tensor(out)
        return out

    def forward(self, x):
        a = self.attention_core(self.linear(self.qkv, "qkv", self.norm1(x)))
        x = x + self.linear(self.proj, "proj", a)
        h = F.gelu(self.linear(self.up, "up", self.norm2(x)))
        return x + self.linear(self.down, "down", h)


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int, mode: str):
        super().__init__()
        self.mode = mode
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(
            Block(dim, heads, 0.1, save_matmuls=(mode == "selective")) for _ in range(layers)
        )
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)
        self.rng = remat.CPURNGStateHook()

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for i, block in enumerate(self.blocks):
            if self.mode == "none":
                x = block(x)
            else:
                ckpt = remat.checkpoint(region_name=f"blocks.{i}", recompute_state_hooks=(self.rng,))
                x = ckpt(block)(x)
        return self.head(self.norm(x))


def load_text() -> str:
    # A snapshot of this project's docs, shipped with the repository, so that runs
    # stay comparable when the docs change.
    return (ROOT / "launch" / "data" / "corpus.txt").read_text()


def saved_bytes_after_forward(model, idx, targets) -> int:
    loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
    return remat.saved_tensors_report(loss).total_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    text = load_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    print(f"data: {len(data):,} characters of the project's docs, vocabulary {len(chars)}")

    def batch(step):
        g = torch.Generator().manual_seed(args.seed * 100_003 + step)
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,), generator=g)
        x = torch.stack([data[s : s + args.seq_len] for s in starts])
        y = torch.stack([data[s + 1 : s + args.seq_len + 1] for s in starts])
        return x, y

    models = {}
    for mode in ("none", "full", "selective"):
        torch.manual_seed(args.seed)
        models[mode] = GPT(len(chars), args.dim, args.layers, args.heads, args.seq_len, mode)

    # 1. Same gradients, bit for bit, whatever the policy.
    x, y = batch(0)
    grads = {}
    for mode, model in models.items():
        torch.manual_seed(1)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        grads[mode] = [q.grad.clone() for q in model.parameters()]
        model.zero_grad()
    same = all(
        torch.equal(a, b) for mode in ("full", "selective") for a, b in zip(grads["none"], grads[mode])
    )
    print(f"gradients identical to no checkpointing (full, selective): {same}")

    # 2. Activation memory held between forward and backward.
    print("bytes saved for backward after the forward:")
    base = None
    for mode, model in models.items():
        n = saved_bytes_after_forward(model, x, y)
        base = base or n
        print(f"  remat={mode:<9} {n:>10,} B  ({n / base:.2f}x of none)")

    # 3. Train with selective remat; the loss falls.
    model = models["selective"]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1, args.steps + 1):
        x, y = batch(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1 or step % 5 == 0:
            print(f"step {step:>3}  loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
