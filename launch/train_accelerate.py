"""Train a small GPT with Hugging Face accelerate and torch_remat.

    torchrun --standalone --nproc-per-node 2 launch/train_accelerate.py
    accelerate launch --multi_gpu --num_processes 2 launch/train_accelerate.py  # 2 ranks, CPU too
    accelerate launch --num_processes 2 launch/train_accelerate.py --fsdp2      # GPUs

(``accelerate launch --num_processes 2 --cpu`` starts one process: ``--cpu`` selects
accelerate's single-process launcher.)

The one line that differs from a plain accelerate script is
``prepare_with_remat(accelerator, ...)`` in place of ``accelerator.prepare(...)``.
With ``--fsdp2`` the FSDP2 plugin asks for activation checkpointing and remat takes
the place of accelerate's checkpoint wrapper. Data: the character-level text of this
repository's documentation; accelerate gives each rank its own batches.
"""

from __future__ import annotations

import argparse
import math
import pathlib

import torch
import torch.nn.functional as F
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch import nn

from torch_remat.integrations import RematConfig, prepare_with_remat, remat_module_names

ROOT = pathlib.Path(__file__).resolve().parent.parent


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        att = att.masked_fill(
            torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1), -math.inf
        )
        att = F.dropout(att.softmax(-1), self.dropout, self.training)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    _no_split_modules = ["Block"]  # what remat and FSDP2 treat as one block

    def __init__(
        self, vocab: int, seq_len: int, dim: int, layers: int, heads: int = 4, dropout: float = 0.1
    ):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def text_windows(seq_len: int) -> tuple[int, torch.Tensor]:
    """(vocabulary size, [n, seq_len + 1] windows of the docs' characters)."""
    text = (ROOT / "launch" / "data" / "corpus.txt").read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    n = (len(data) - 1) // seq_len
    return len(chars), torch.stack(
        [data[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]
    )


def train(argv=None) -> dict:
    """Train; returns the per-step losses (averaged over ranks) and the checkpointed
    modules. The process group stays up, so that one process can train twice."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--remat", choices=["none", "full"], default="full")
    p.add_argument(
        "--fsdp2", action="store_true", help="FSDP2 plugin with activation checkpointing"
    )
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    plugin = None
    if args.fsdp2:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            activation_checkpointing=True,
        )
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), fsdp_plugin=plugin)
    if args.fsdp2 and accelerator.distributed_type != DistributedType.FSDP:
        accelerator.print("note: accelerate uses FSDP only on GPUs; on CPU it trains with DDP")

    vocab, windows = text_windows(args.seq_len)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(windows),
        batch_size=args.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = GPT(vocab, args.seq_len, args.dim, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    remat = RematConfig(enabled=args.remat != "none")
    model, optimizer, loader = prepare_with_remat(
        accelerator, model, optimizer, loader, remat=remat
    )
    checkpointed = remat_module_names(accelerator.unwrap_model(model))
    accelerator.print(
        f"{accelerator.distributed_type.value}, {accelerator.num_processes} processes, "
        f"remat on {checkpointed or 'nothing'}"
    )

    torch.manual_seed(args.seed + accelerator.process_index)  # dropout differs per rank
    losses, step = [], 0
    while step < args.steps:
        for (batch,) in loader:
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
            step += 1
            if step == 1 or step % 10 == 0 or step == args.steps:
                accelerator.print(f"step {step:4d}  loss {losses[-1]:.4f}")
            if step == args.steps:
                break
    return {"losses": losses, "remat_modules": checkpointed}


def main(argv=None) -> dict:
    result = train(argv)
    # Left to the interpreter's exit, the process group's threads can still be running
    # when the process ends: about one run in nine under torchrun then aborts with
    # "terminate called without an active exception" (exit status 1).
    PartialState().destroy_process_group()
    return result


if __name__ == "__main__":
    main()
